"""What ``pip install .`` puts into site-packages: the one ``hybrid_pd`` namespace, with what it needs at run time.

Generic top-level names (``services``, ``connector``) would break, or be broken by, any other
installed project that has them. The wheel is built from this tree as pip builds it for an
install, and its file list read.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wheel_files(tmp_path: Path) -> list[str]:
    """The files of the wheel pip builds from a copy of this tree (setuptools writes build/ and *.egg-info beside the sources)."""
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "hybrid_pd", source / "hybrid_pd", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("hybrid_pd-*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_the_wheel_installs_only_the_hybrid_pd_package(tmp_path):
    files = _wheel_files(tmp_path)
    top = {name.split("/", 1)[0] for name in files}
    assert {t for t in top if not t.endswith(".dist-info")} == {"hybrid_pd"}
    entry_points = next(n for n in files if n.endswith(".dist-info/entry_points.txt"))
    assert "hybrid-pd = hybrid_pd.cli:main" in zipfile.ZipFile(next(tmp_path.glob("*.whl"))).read(entry_points).decode()
    # What runs in production and what vLLM loads by module path is there; measurements are not.
    assert {"hybrid_pd/connector/vllm/nixl_connector.py", "hybrid_pd/connector/trace/http.py", "hybrid_pd/router/app.py",
            "hybrid_pd/eval/data/gsm8k/test.jsonl", "hybrid_pd/models/hybrid-pd-tiny/model.safetensors",
            "hybrid_pd/sizing/profiles/tiny-cpu.json", "hybrid_pd/sizing/profiles/nemotron-h-8b-h100.json"} <= set(files)  # fmt: skip
    assert not [n for n in files if n.startswith("hybrid_pd/bench/results/")]
