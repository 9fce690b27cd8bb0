"""Where a stalled vLLM stuck: the Python stacks of its processes, read with ``py-spy dump`` before it is ended.

Why (issue #36): a prefill worker's vLLM went silent mid-start and was ended after the start window;
its log said how long it had been silent, not where. By hand, ``py-spy dump`` showed the engine core
waiting in ``EngineCore._initialize_kv_caches`` -> ``collective_rpc`` on a model worker starved of CPU.
The worker service now writes those stacks into its log when it judges vLLM stalled: its API server,
engine core and model workers, each dumped within ``timeout_s``; and, while serving, each time vLLM says one of
its processes waited 60 s for another (a model worker reading no step: the slower host's wedged prefill,
docs/reliability.md), without ending vLLM for it. A dump that cannot be taken (py-spy
missing, no permission to read another process's memory, the process gone) says why in one line and the
next is tried: nothing here may keep a stalled vLLM from being ended.

py-spy reads a stopped (SIGSTOP) process's stack only once it runs: such a process is sent SIGCONT
first (the verdict on it is already made; it is about to be ended) and the dump says so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from hybrid_pd.common.processes import Proc

__all__ = ["dump_stacks", "py_spy"]


def py_spy() -> str | None:
    """The py-spy beside this interpreter (a virtual environment's bin/, not always on PATH), else PATH's, else None."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which("py-spy")


def _dump(tool: str, proc: Proc, timeout_s: float) -> str:
    try:
        done = subprocess.run([tool, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"py-spy dump took longer than {timeout_s:.0f} s"
    except OSError as exc:
        return f"py-spy could not run: {exc}"
    if done.returncode != 0:
        first = next((line for line in (done.stderr or done.stdout).splitlines() if line.strip()), "no output")
        return f"py-spy dump failed (exit {done.returncode}): {first.strip()}"
    return done.stdout.rstrip()


def dump_stacks(procs: Iterable[tuple[str, Proc]], timeout_s: float = 10.0, tool: str | None = None) -> str:
    """Each named process's Python stacks, one block each, or the line that says why it could not be dumped."""
    tool = tool or py_spy()
    blocks = []
    for name, proc in procs:
        head = f"--- {name} (pid {proc.pid})"
        if tool is None:
            blocks.append(f"{head}: py-spy is not installed (pip install py-spy)")
            continue
        if proc.stopped:
            try:
                os.kill(proc.pid, signal.SIGCONT)
                head += ", stopped (SIGSTOP): continued to read its stack"
            except OSError as exc:
                blocks.append(f"{head}: stopped (SIGSTOP), and could not be continued to read its stack: {exc}")
                continue
        blocks.append(f"{head}:\n{_dump(tool, proc, timeout_s)}")
    return "\n".join(blocks)
