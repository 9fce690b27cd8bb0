"""One vLLM worker's continuous batching, step by step, as its V1 scheduler does it (simplified).

Each step has a token budget (``max_num_batched_tokens``). The running sequences go first, in
the order they started: a decoding one takes one token, one still in its prompt as much of the
rest as the budget allows (chunked prefill). Each holds KV-cache memory for the tokens it has
computed (:meth:`Profile.memory_bytes`) and gets more as it grows; when the cache has none left,
the sequence that started last is preempted (its memory freed, it goes back to the front of the
queue and is computed again from its tokens), as vLLM's recompute preemption does. Then the
waiting ones, first come first served, while fewer than ``max_num_seqs`` run, the budget lasts
and the cache has room for their chunk; the first that does not fit stops the rest. A decode leg
of P/D first needs its state: the scheduler gives it memory for the state (and the token it
computes) and starts the pull; it waits, passed over by the others, until the pull is done, then
computes its one remaining prompt token like any prompt. On a busy worker vLLM's asynchronous scheduling
(0.26's default, which decode and flexible workers keep) delays both ends by a step: the step that admits a
decode leg is planned while the one before it runs, so its pull is posted a step later
(:meth:`Engine.pull_posted_ms`), and a pull done while a step runs is reported by that step, when the next
one is planned already (:meth:`Engine.pulled`). An idle worker has no step to wait for. The step lasts :meth:`Profile.step_ms` of its decode rows and
prompt tokens; at its end, a sequence whose prompt is done samples a token (its first, unless it
was preempted), a decoding one its next.

A job may start with tokens already in the cache (``context``, a prefix-cache hit of a later turn:
the simulation decides how many, :func:`hybrid_pd.sizing.simulate.reusable`); it computes only the
rest. Left out, because the measurements the simulator is checked against cannot tell them apart:
async scheduling's other effects (vLLM 0.26 plans step k+1 while k runs: a prompt's first token and each
next one), the prefix cache's own memory (a hit's
blocks count as the job's, and nothing is evicted), the model length limit.

A run of pure decode steps in which nothing can change (every running sequence decodes, none
needs memory the cache lacks, no pull starts) is planned at once, up to the first sequence that
finishes: the same steps, without an event each. Whatever reaches the worker meanwhile (a
request, a finished pull, freed memory) ends the run with the step in progress
(:meth:`Engine.interrupt`), where the scheduler would have seen it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from hybrid_pd.sizing.profile import Profile

__all__ = ["Engine", "Job", "Step"]

Pull = Literal["none", "wanted", "pulling", "done"]


@dataclass(eq=False)
class Job:
    """A request's work on one engine: a whole request, a prefill leg (no outputs) or a decode leg (a pull first)."""

    request_id: int
    prompt_left: int  # tokens still to compute before the next token is sampled
    context: int  # tokens computed: their state and KV are in this engine's cache
    outputs_left: int  # tokens still to sample here; 0: done when its prompt is (a prefill leg)
    pull_ms: float = 0.0  # the state's transfer (a decode leg)
    pull: Pull = "none"
    lag: int = 0  # plans that pass over a pulled decode leg before it may run (the scheduler learns of the pull late)
    memory: int = field(default=0, init=False)  # KV-cache bytes it holds here
    covered: int = field(default=0, init=False)  # tokens that memory holds (whole blocks; 0: none)


@dataclass(frozen=True)
class Step:
    """A planned step, or a run of ``count`` pure decode steps, each ``growth_ms`` longer than the one before (its rows' context grew)."""

    tokens: tuple[tuple[Job, int], ...]  # each scheduled job and its tokens in one step
    start_ms: float
    first_ms: float  # the first step's duration
    growth_ms: float
    count: int

    def end_after(self, steps: int) -> float:
        return self.start_ms + steps * self.first_ms + self.growth_ms * steps * (steps - 1) / 2

    @property
    def end_ms(self) -> float:
        return self.end_after(self.count)


class Engine:
    """The scheduler's state of one worker; the simulation drives it with :meth:`plan` and :meth:`finish`."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.free_bytes = profile.cache_bytes
        self._state_bytes, self._block_bytes = profile.memory_layout()
        self._block_tokens = profile.block_tokens
        self.step: Step | None = None  # the step in progress

    def submit(self, job: Job) -> None:
        self.waiting.append(job)

    def release(self, job: Job) -> None:
        """Give back ``job``'s memory (done, or a prefill leg whose state was pulled)."""
        self.free_bytes += job.memory
        job.memory = job.covered = 0

    def plan(self, now_ms: float) -> tuple[Step | None, list[Job]]:
        """Schedule the next step from ``now_ms`` (None: nothing to run) and the decode legs whose pulls it started."""
        p = self.profile
        budget = p.max_num_batched_tokens
        tokens: list[tuple[Job, int]] = []
        preempted = False
        while len(tokens) < len(self.running) and budget > 0:
            job = self.running[len(tokens)]
            n = min(job.prompt_left, budget) if job.prompt_left else 1
            while not self._grow(job, job.context + n) and self.running[-1] is not job:
                self._preempt(self.running.pop())
                preempted = True
            if job.covered < job.context + n:  # not even with the later ones gone: it goes back too
                self._preempt(self.running.pop())
                preempted = True
                break
            tokens.append((job, n))
            budget -= n
        pulls = []
        lagged = False
        i = 0
        while not preempted and i < len(self.waiting) and budget > 0:  # vLLM admits none in a step that preempted
            job = self.waiting[i]
            if job.pull == "pulling" or job.lag:
                lagged |= job.lag > 0
                job.lag = max(job.lag - 1, 0)
                i += 1
            elif job.pull == "wanted":  # memory for the state and the tokens it computes: once pulled, it needs no more to start
                if not self._grow(job, job.context + job.prompt_left):
                    break
                job.pull = "pulling"
                pulls.append(job)
                i += 1
            else:
                n = min(job.prompt_left, budget)
                if len(self.running) >= p.max_num_seqs or not self._grow(job, job.context + n):
                    break
                self.running.append(self.waiting.pop(i))
                tokens.append((job, n))
                budget -= n
        if not tokens:
            if lagged:  # nothing else runs: the step that reported the pull was the last, so this plan sees it
                step, more = self.plan(now_ms)
                return step, pulls + more
            return None, pulls
        prompt = sum(n for job, n in tokens if job.prompt_left)
        prompts = sum(1 for job, _ in tokens if job.prompt_left)
        rows = [job for job, _ in tokens if not job.prompt_left]
        context = sum(job.context for job in rows)
        count = 1
        if not prompt and not pulls and not lagged and len(tokens) == len(self.running):
            last, bt = min(job.outputs_left for job in rows), self._block_tokens
            if sum(-(-(job.context + last) // bt) - job.covered // bt for job in rows) * self._block_bytes <= self.free_bytes:
                for job in rows:  # the run's memory, now; what a run cut short did not use comes back at its end
                    self._grow(job, job.context + last)
                count = last
        growth = p.step_ms(len(rows), context + len(rows), 0) - p.step_ms(len(rows), context, 0)
        self.step = Step(tuple(tokens), now_ms, p.step_ms(len(rows), context, prompt, prompts), growth, count)
        return self.step, pulls

    def pull_posted_ms(self, now_ms: float) -> float:
        """When the pulls :meth:`plan` started at ``now_ms`` are posted: with the step it planned (asynchronous
        scheduling planned that one while the step before it ran, so it posts them as the step after it
        starts), at once on an idle worker."""
        return self.step.end_ms if self.step is not None else now_ms

    def pulled(self, job: Job) -> None:
        """``job``'s state is here. While a step runs, that step reports it, and the next step is planned
        already: the plan after that one is the first to see it."""
        job.pull = "done"
        job.lag = 1 if self.step is not None else 0

    def interrupt(self, now_ms: float) -> Step | None:
        """Something reached the worker at ``now_ms``: a run of steps ends with the step in progress. The shortened step, if it was shortened."""
        step = self.step
        if step is None or step.end_after(step.count - 1) < now_ms:
            return None
        low, high = 1, step.count - 1  # the first step that ends at or after now_ms
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if step.end_after(mid) >= now_ms else (mid + 1, high)
        self.step = replace(step, count=low)
        return self.step

    def finish(self) -> tuple[list[Job], list[Job]]:
        """Apply the step in progress: the jobs that sampled a token after their prompt, and those done (removed; the caller releases their memory)."""
        step, self.step = self.step, None
        assert step is not None, "finish() without a step in progress"
        sampled, done = [], []
        for job, n in step.tokens:
            if job.prompt_left:
                job.prompt_left -= n
                job.context += n
                if job.prompt_left:
                    continue
                if job.outputs_left:
                    job.outputs_left -= 1
                    sampled.append(job)
            else:
                job.outputs_left -= step.count
                job.context += step.count
            kept = -(-job.context // self._block_tokens) * self._block_tokens
            if kept < job.covered:  # a run cut short by an event reserved more
                surplus = (job.covered - kept) // self._block_tokens * self._block_bytes
                self.free_bytes += surplus
                job.memory -= surplus
                job.covered = kept
            if not job.outputs_left:
                done.append(job)
        if done:
            gone = set(map(id, done))
            self.running = [job for job in self.running if id(job) not in gone]
        return sampled, done

    def _bytes(self, tokens: int) -> int:
        return self._state_bytes + self._block_bytes * -(-tokens // self._block_tokens)

    def _grow(self, job: Job, tokens: int) -> bool:
        """Give ``job`` the memory of ``tokens`` tokens if the cache has it (it holds its state and whole blocks: ``covered`` tokens)."""
        if tokens <= job.covered:
            return True
        need = self._bytes(tokens) - job.memory
        if need > self.free_bytes:
            return False
        self.free_bytes -= need
        job.memory += need
        job.covered = -(-tokens // self._block_tokens) * self._block_tokens
        return True

    def _preempt(self, job: Job) -> None:
        """vLLM's recompute preemption: ``job`` gives its memory back and waits first in line to compute all its tokens again."""
        self.release(job)
        job.prompt_left = job.context + (job.prompt_left or 1)  # a decoding job's sampled token is not computed yet
        job.context = 0
        self.waiting.insert(0, job)
