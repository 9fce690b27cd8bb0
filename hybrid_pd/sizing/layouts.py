"""The layouts of a number of GPUs, one worker per GPU.

- ``replicas``: colocated vLLM servers behind the router, each serving whole requests.
- ``flex``: flexible workers (``hybrid-pd flex``) serving whole requests, as the router runs them
  without SLOs. The simulator runs them as replicas: on two H100s they measured within the
  run-to-run spread of the replicas (docs/performance.md); the phase split is not simulated.
- ``xPyD``: x prefill and y decode workers, every split with at least one of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RUNNER_SYSTEMS", "Layout", "layouts"]


@dataclass(frozen=True)
class Layout:
    kind: Literal["replicas", "flex", "pd"]
    prefill: int  # prefill workers (pd only)
    decode: int  # workers that decode: the replicas, the flexible workers, or pd's decode workers

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"{self.prefill}P{self.decode}D" if self.kind == "pd" else f"{self.decode} {self.kind}"


# The two-GPU runners' systems (hybrid_pd.bench.gpu.goodput.SYSTEMS), by their names, as the simulator lays them out.
RUNNER_SYSTEMS = {"replicas": Layout("replicas", 0, 2), "adaptive": Layout("flex", 0, 2), "pd": Layout("pd", 1, 1)}


def layouts(gpus: int) -> list[Layout]:
    """Every layout of ``gpus`` GPUs: replicas, flexible workers, then each xPyD split by prefill workers."""
    whole = [Layout("replicas", 0, gpus), Layout("flex", 0, gpus)]
    return whole + [Layout("pd", x, gpus - x) for x in range(1, gpus)]
