"""The decode worker service: a vLLM server that consumes state (NIXL ``kv_consumer``).

It pulls h(N-1) from the prefill worker, recomputes token N as a decode row and
generates the answer.
"""

from services.common.worker import WorkerSettings, run_worker

__all__ = ["main"]


def main(settings: WorkerSettings) -> int:
    """Run the decode worker until it is stopped; return its exit code."""
    return run_worker("decode", settings)
