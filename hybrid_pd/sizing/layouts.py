"""The layouts of a number of GPUs, each worker on ``tp`` GPUs of its own (vLLM's tensor parallelism).

- ``replicas``: colocated vLLM servers behind the router, each serving whole requests.
- ``flex``: flexible workers (``hybrid-pd flex``) serving whole requests, as the router runs them
  without SLOs. The simulator runs them as replicas: on two H100s they measured within the
  run-to-run spread of the replicas (docs/performance.md); the phase split is not simulated.
- ``xPyD``: x prefill and y decode workers, every split with at least one of each; the two roles
  may differ in tensor-parallel size where one size divides the other (heterogeneous TP, the rule
  the router pairs workers by: :func:`hybrid_pd.connector.compat.tp_sizes_pair`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hybrid_pd.connector.compat import tp_sizes_pair

__all__ = ["RUNNER_SYSTEMS", "Layout", "layouts"]


@dataclass(frozen=True)
class Layout:
    kind: Literal["replicas", "flex", "pd"]
    prefill: int  # prefill workers (pd only)
    decode: int  # workers that decode: the replicas, the flexible workers, or pd's decode workers
    prefill_tp: int = 1  # GPUs of a prefill worker (pd only)
    decode_tp: int = 1  # GPUs of a worker that decodes

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def tp_sizes(self) -> set[int]:
        """The tensor-parallel sizes of its workers: the profiles it needs."""
        return {self.prefill_tp, self.decode_tp} if self.kind == "pd" else {self.decode_tp}

    @property
    def name(self) -> str:
        """``1P2D``, ``2 replicas``; with tensor parallelism each role's size, ``1P(TP2)2D`` or ``2 replicas (TP2)``."""
        if self.kind == "pd":
            if self.tp_sizes == {1}:
                return f"{self.prefill}P{self.decode}D"
            return f"{self.prefill}P(TP{self.prefill_tp}){self.decode}D(TP{self.decode_tp})"
        return f"{self.decode} {self.kind}" + (f" (TP{self.decode_tp})" if self.decode_tp != 1 else "")


# The two-GPU runners' systems (hybrid_pd.bench.gpu.goodput.SYSTEMS), by their names, as the simulator lays them out.
RUNNER_SYSTEMS = {"replicas": Layout("replicas", 0, 2), "adaptive": Layout("flex", 0, 2), "pd": Layout("pd", 1, 1)}


def layouts(gpus: int, tp_sizes: Iterable[int] = (1,)) -> list[Layout]:
    """Every layout of exactly ``gpus`` GPUs with workers of the given tensor-parallel sizes.

    In order: replicas, then flexible workers (each size, smallest first), then each xPyD split
    by prefill GPUs and prefill worker size.
    """
    sizes = sorted(set(tp_sizes))
    whole = [Layout(kind, 0, gpus // tp, tp, tp) for kind in ("replicas", "flex") for tp in sizes if gpus % tp == 0]
    split = [
        Layout("pd", x, (gpus - x * p_tp) // d_tp, p_tp, d_tp)
        for x in range(1, gpus)
        for p_tp in sizes
        for d_tp in sizes
        if tp_sizes_pair(p_tp, d_tp) and 0 < gpus - x * p_tp and (gpus - x * p_tp) % d_tp == 0
    ]
    return whole + sorted(split, key=lambda layout: (layout.prefill * layout.prefill_tp, layout.prefill_tp))
