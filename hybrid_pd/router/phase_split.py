"""When flexible workers split by phase: one prefills for the others, which only decode; otherwise each serves whole requests.

Measured on two H100s at real scale (docs/performance.md): the same two GPUs serve more as
colocated replicas on almost every workload, and a fixed 1 prefill + 1 decode split wins in
one regime: the time to first token is what breaks the SLO (bursts of prompts wait behind
the decode steps they share a GPU with) while decoding has TPOT to spare, so that moving
every decode onto the other GPUs costs TPOT it can afford. Where TPOT is tight, or one GPU
cannot prefill the traffic alone, the split serves far less. So the router runs flexible
workers as replicas and splits them by phase only while those conditions hold, and it goes
back when the split does not help:

- **enter** (replicas -> split): the median TTFT of the last ``window`` streamed requests is
  above the TTFT target, and the flexible workers' TPOT is below ``split_below`` of the TPOT
  target; the worker decoding fewest requests becomes the prefiller;
- **leave, it failed** (split -> replicas, and no new split for ``hold_s``): with ``window``
  requests that arrived after the split, their median TTFT is still above the target (one GPU
  does not keep up with the prompts), or TPOT passed ``leave_above`` of its target (the others
  do not keep up with the decodes). Requests that arrived before the switch are not counted:
  on two H100s they carried the queue of the replicas into the split's first window and ended
  a split that was working (median 517 ms just after it began, at 1000/512 with 64 in flight);
- **leave, it is quiet**: their median TTFT is below ``quiet_below`` of the target; replicas
  answer sooner at low load (no hand-off).

Only streamed requests give the router a TTFT and a TPOT; without both targets it never splits.
Pure state over typed inputs: :meth:`PhaseSplit.update` is given the time and the workers' loads.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybrid_pd.common.logs import kv
from hybrid_pd.router.load import LoadView

__all__ = ["FlexLoad", "PhaseSplit", "SplitPolicy"]

log = logging.getLogger("hybrid_pd.router")


@dataclass(frozen=True)
class SplitPolicy:
    """The targets and thresholds of :class:`PhaseSplit` (seconds; None: no target, never split)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    split_below: float = 0.6  # enter only while TPOT is below this share of its target (RouterSettings.split_below_tpot)
    leave_above: float = 0.8  # leave when TPOT passes this share of its target
    quiet_below: float = 0.2  # leave when the median TTFT falls below this share of its target
    window: int = 16  # TTFTs a decision rests on
    hold_s: float = 60.0  # after a split that failed, none for this long

    @property
    def enabled(self) -> bool:
        return self.ttft_s is not None and self.tpot_s is not None


@dataclass(frozen=True)
class FlexLoad:
    """A flexible worker as the controller sees it."""

    id: str
    load: LoadView


@dataclass
class PhaseSplit:
    """The router's split state: ``prefiller`` is the flexible worker that prefills for the others, None while they serve as replicas."""

    policy: SplitPolicy
    prefiller: str | None = None
    _ttfts: deque[float] = field(default_factory=deque)
    _hold_until: float = 0.0
    _since: float = float("-inf")  # when the mode last changed: older requests tell of the mode before

    def observe_ttft(self, arrived: float, seconds: float) -> None:
        """A streamed request that reached the router at ``arrived`` (``time.perf_counter()``) sent its first chunk ``seconds`` later."""
        if arrived < self._since:
            return
        self._ttfts.append(seconds)
        if len(self._ttfts) > self.policy.window:
            self._ttfts.popleft()

    def update(self, now: float, flex: Sequence[FlexLoad]) -> str | None:
        """Enter or leave the split from the signals so far; the prefiller after it (None: replicas)."""
        policy = self.policy
        if not policy.enabled or len(flex) < 2:
            return self._leave(now, "too few flexible workers" if policy.enabled else "no targets", hold=False) if self.prefiller else None
        if self.prefiller is not None and self.prefiller not in {f.id for f in flex}:
            return self._leave(now, "the prefiller left", hold=False)
        if len(self._ttfts) < policy.window:
            return self.prefiller
        ttft = statistics.median(self._ttfts)
        tpots = [f.load.tpot_s for f in flex if f.load.tpot_s is not None and f.id != self.prefiller]
        tpot = max(tpots) if tpots else None
        if self.prefiller is None:
            if now >= self._hold_until and ttft > policy.ttft_s and tpot is not None and tpot < policy.split_below * policy.tpot_s:
                self.prefiller = min(flex, key=lambda f: (f.load.decodes, f.id)).id
                self._ttfts.clear()
                self._since = now
                log.info("phase split on %s", kv(prefiller=self.prefiller, ttft_ms=round(ttft * 1e3), tpot_ms=round(tpot * 1e3, 1)))
            return self.prefiller
        if ttft > policy.ttft_s or (tpot is not None and tpot > policy.leave_above * policy.tpot_s):
            return self._leave(now, f"ttft_ms={round(ttft * 1e3)} tpot_ms={None if tpot is None else round(tpot * 1e3, 1)}", hold=True)
        if ttft < policy.quiet_below * policy.ttft_s:
            return self._leave(now, f"quiet: ttft_ms={round(ttft * 1e3)}", hold=False)
        return self.prefiller

    def _leave(self, now: float, why: str, hold: bool) -> None:
        log.info("phase split off %s", kv(prefiller=self.prefiller, why=why, hold_s=self.policy.hold_s if hold else 0))
        self.prefiller = None
        self._ttfts.clear()
        self._since = now
        if hold:
            self._hold_until = now + self.policy.hold_s
        return None
