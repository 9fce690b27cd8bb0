"""The prefill worker service: a vLLM server that produces state (NIXL ``kv_producer``).

It runs each prompt up to token N-1 and holds h(N-1) (the conv and SSM state of
every Mamba layer, plus the attention KV) until the decode worker pulls it.
"""

from services.common.worker import WorkerSettings, run_worker

__all__ = ["main"]


def main(settings: WorkerSettings) -> int:
    """Run the prefill worker until it is stopped; return its exit code."""
    return run_worker("prefill", settings)
