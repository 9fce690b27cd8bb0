"""Keep NIXL's UCX progress thread from spinning a whole core.

NIXL's Python agent (``nixl._api.nixl_agent``) starts the UCX backend's progress
thread with ``pthrDelay = 0``: the thread then calls ``poll()`` with a zero timeout
in a loop and burns one core per vLLM worker, idle or not (measured: 1.0 CPU-second
per second with nixl 1.5.1). On a GPU node that is one host core per worker; on a
CPU-only machine it starves the engines themselves. On a 2-core box with a
prefill and two decode workers, three spinning threads made 0.2 MB transfers take
5-44 s; some outlived the prefill's 30 s KV lease, so the decode read blocks that
had been freed and reused, and answered wrongly.

With a delay of at least 1 us, the thread sleeps in ``poll()`` (UCX event fds
wake it when work arrives; NIXL rounds the delay up to 1 ms for its periodic
wake-up). Turning the thread off is no remedy: the prefill side of a READ over
TCP then never progresses and every pull waits out the lease.

``nixl_agent`` exposes no setting for the delay, so :func:`throttle_progress_thread`
substitutes the agent-config class it instantiates with one whose ``pthrDelay``
never drops below the given delay. Call it before vLLM creates its agent.
"""

from __future__ import annotations

import sys

__all__ = ["throttle_progress_thread"]



def throttle_progress_thread(delay_us: int) -> type:
    """Make every NIXL agent created from now on wait ``delay_us`` (at least) between polls.

    Returns the agent-config class now in use. Raises ``RuntimeError`` when the
    installed NIXL does not have the config field this relies on.
    """
    if delay_us < 1:
        raise ValueError(f"the progress-thread delay must be >= 1 us (got {delay_us})")
    from vllm.distributed.nixl_utils import NixlWrapper  # the NIXL flavour vLLM picked (cu12, cu13, rocm)

    if NixlWrapper is None:
        raise RuntimeError("NIXL is not importable in this process")
    bindings = sys.modules[NixlWrapper.__module__].nixlBind
    base = getattr(bindings, "_unthrottled_config", bindings.nixlAgentConfig)
    field = getattr(base, "pthrDelay", None)
    if not isinstance(field, property):
        raise RuntimeError(f"{base.__module__}.{base.__name__} has no pthrDelay field: NIXL changed, revisit hybrid_pd/connector/vllm/nixl_progress.py")

    class ThrottledAgentConfig(base):  # type: ignore[misc, valid-type] - a pybind11 class
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return field.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            field.__set__(self, max(int(value), delay_us))

    bindings._unthrottled_config = base
    bindings.nixlAgentConfig = ThrottledAgentConfig
    return ThrottledAgentConfig
