"""The temporary directory each vLLM server gets (hybrid_pd.worker.scratch); tests/test_worker_start.py runs it under a worker."""

from __future__ import annotations

import os
import socket
import tempfile

from hybrid_pd.worker.scratch import clear_rendezvous, release, scratch_dir, scratch_env


def test_a_server_keeps_its_directory_across_restarts_and_only_its_owner_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = scratch_dir(8000)
    assert first == scratch_dir(8000) == tmp_path / "hybrid-pd-vllm-8000"
    assert first != scratch_dir(8001)
    assert first.stat().st_mode & 0o777 == 0o700
    assert scratch_env(first) == {"TMPDIR": str(first)}


def test_a_directory_someone_else_put_there_first_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    (tmp_path / "hybrid-pd-vllm-8000").symlink_to(elsewhere)
    chosen = scratch_dir(8000)
    assert chosen.parent == tmp_path and chosen.name.startswith("hybrid-pd-vllm-8000-") and not chosen.is_symlink()
    assert os.listdir(elsewhere) == []


def test_only_sockets_and_file_stores_are_cleared(tmp_path):
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "8e1f-uuid"))
    for name in ("vllm_dist_5e3a", "cache.bin", "vllm_dist_kept.d/"):
        (tmp_path / name.rstrip("/")).mkdir() if name.endswith("/") else (tmp_path / name).write_text("x")
    assert clear_rendezvous(tmp_path) == ["8e1f-uuid", "vllm_dist_5e3a"]
    assert sorted(os.listdir(tmp_path)) == ["cache.bin", "vllm_dist_kept.d"]
    assert clear_rendezvous(tmp_path / "missing") == []


def test_a_directory_left_with_empty_folders_only_is_removed_one_with_a_cache_is_kept(tmp_path):
    emptied, cached = tmp_path / "a", tmp_path / "b"
    for d in (emptied, cached):
        (d / "torchinductor_root" / "x").mkdir(parents=True)
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(d / "sock"))
    (cached / "torchinductor_root" / "x" / "kernel.so").write_text("x")
    assert release(emptied) == release(cached) == ["sock"]
    assert not emptied.exists()
    assert sorted(str(p.relative_to(cached)) for p in cached.rglob("*")) == ["torchinductor_root", "torchinductor_root/x", "torchinductor_root/x/kernel.so"]
