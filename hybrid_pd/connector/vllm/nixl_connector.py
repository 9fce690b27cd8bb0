"""The NixlConnector our workers load into vLLM: vLLM's own, plus our fixes and hooks.

vLLM loads it through ``kv_connector_module_path=hybrid_pd.connector.vllm.nixl_connector`` (see
:func:`hybrid_pd.connector.launch.kv_transfer_config`) on every prefill and decode worker;
it is vLLM's pull connector, with the fixes and hooks below switched on per worker.

1. **Pure-Mamba handshake.** vLLM's NIXL worker sizes the reads of every KV region
   by the source ranks of the *attention* group (``_build_fa_remote``). A model
   without attention layers (``Mamba2ForCausalLM``) has no such group, so the
   decode worker's handshake dies with ``StopIteration`` and every P/D request gets
   HTTP 500 (measured on vLLM 0.32). The Mamba groups read from the same prefill
   ranks, so for such a model the first group stands in for the missing attention
   group while vLLM builds the remote descriptors; nothing else changes. Hybrid
   models take vLLM's path untouched. This override reaches into vLLM internals,
   so it is applied only on the vLLM versions it was tested with; on others a
   model without attention is refused at start with a message saying so.
2. **Idle progress thread.** When ``HYBRID_PD_NIXL_PROGRESS_DELAY_US`` is set,
   NIXL's progress thread sleeps between polls instead of spinning a core
   (:mod:`hybrid_pd.connector.vllm.nixl_progress`).
3. **Fewer descriptors.** When ``HYBRID_PD_NIXL_MERGE_DESCRIPTORS`` is set, reads that
   are adjacent on both sides (a Mamba layer's x, B, C and SSM state) are posted as
   one descriptor (:mod:`hybrid_pd.connector.vllm.nixl_merge`).
4. **Transfer trace.** When ``HYBRID_PD_NIXL_TRACE_DIR`` is set, every transfer the
   worker posts is recorded at the NIXL API (:mod:`hybrid_pd.connector.vllm.nixl_trace`).
5. **No pull of released state.** The prefill stamps when its KV lease runs out into
   the ``kv_transfer_params`` it answers with; the decode worker reports a pull that
   completed after that as failed, and vLLM recomputes the prompt locally instead of
   generating from blocks the prefill had already freed and reused
   (:mod:`hybrid_pd.connector.vllm.kv_lease`). Always on: it uses only vLLM's connector interface.
6. **Start-up capability fallbacks** (:mod:`hybrid_pd.connector.vllm.capabilities`), applied as the
   worker decided them at start (``HYBRID_PD_CAPABILITIES``): our copy of vLLM's
   decode-row reclassification (:mod:`hybrid_pd.connector.vllm.decode_rows`) where vLLM lacks it, and
   the lease checked before a pull where vLLM cannot report a failed one. Both are
   reported on vLLM's ``/metrics`` as ``hybrid_pd:capability{capability,state}``.
7. **Hand-off timeline.** When ``HYBRID_PD_TIMELINE_DIR`` is set, the engine records
   when it queued, scheduled and finished each traced request and when its pulls were
   posted and noticed complete (:mod:`hybrid_pd.connector.vllm.timeline_engine`); vLLM's HTTP server
   records the request's arrival and first byte out (:mod:`hybrid_pd.connector.trace.http`).
8. **The shortest prompts computed on the decode worker.** A one-token prompt has no h(N-1) to
   hand off, and for a two-token one the prefill's N-1 = 1 token would run as a one-token prompt,
   which vLLM answers from stale state under FULL CUDA graphs (vllm-project/vllm#57720); the
   decode worker computes prompts of up to ``hybrid_pd.connector.plan.LOCAL_PROMPT_TOKENS`` tokens itself.
9. **Pulls noticed in the step that posted them.** When ``HYBRID_PD_PULL_AWAIT_US`` is set,
   the decode worker waits, up to that long, for the reads it posted in an engine step that
   runs no model to complete before vLLM looks at them in that step
   (:mod:`hybrid_pd.connector.vllm.pull_await` says why).
10. **A local hit that leaves the state to pull.** With prefix caching on, a decode worker whose
   attention KV covers all N-1 tokens handed off, but not their state, pulls the last block and
   the state instead of prefilling the whole prompt itself (:mod:`hybrid_pd.connector.vllm.state_pull_hit`).
11. **The early decode leg.** A prefill whose leg names a decode worker's URL and a hand-off key pushes
   its ``kv_transfer_params`` there the moment it ends (:mod:`hybrid_pd.connector.vllm.handoff` says why). With
   ``HYBRID_PD_HANDOFF_INBOX`` set, a decode worker's scheduler holds its early legs until their push
   reaches its engine's own inbox there (:mod:`hybrid_pd.connector.vllm.scheduler_hold`).
12. **The model on its own cores.** vLLM's connector worker moves the CPU model worker's main thread, the
   one that runs the model, to the last core of the NUMA node; it is put back on the cores OpenMP bound it to
   (``VLLM_CPU_OMP_THREADS_BIND``, :mod:`hybrid_pd.connector.vllm.cpu_affinity` says why).
13. **Negative control, tests only.** ``HYBRID_PD_TEST_ONLY_DISABLE_DECODE_ROW_FIX=1``
   removes vLLM's decode-row reclassification in this engine, behind the start-up
   checks' back: what a vLLM without it does. On a GPU with FULL CUDA graphs such a
   decode worker answers wrongly (``hybrid_pd/bench/gpu/gsm8k_gate.py`` shows it).

Hooks 2-4 and 9 act on NIXL, not on vLLM, and work with every vLLM we support.
"""

from __future__ import annotations

import json
import logging
import os
import time
from urllib.parse import urlsplit

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import _is_attention_spec
from vllm.v1.kv_cache_interface import AttentionSpec

from hybrid_pd.connector.contract import (
    AWAIT_ENV,
    CAPABILITIES_ENV,
    DECODE_ROW,
    DELAY_ENV,
    FAILED_PULLS,
    HANDOFF_INBOX_ENV,
    HANDOFF_KEY_PARAM,
    HANDOFF_URL_PARAM,
    LOCAL_PROMPT_TOKENS,
    MERGE_ENV,
    TEST_ONLY_DISABLE_ENV,
    TRACE_ENV,
)
from hybrid_pd.connector.trace.timeline import from_env as timeline_writer
from hybrid_pd.connector.vllm.capabilities import reports_failed_pulls, vllm_version
from hybrid_pd.connector.vllm.cpu_affinity import kept_affinity
from hybrid_pd.connector.vllm.decode_rows import apply_fix, remove_vllm_fix
from hybrid_pd.connector.vllm.handoff import WAIT_LIMIT_S, Outbox
from hybrid_pd.connector.vllm.kv_lease import lease_expiry, pull_outlived_lease, stamp_lease
from hybrid_pd.connector.vllm.nixl_merge import merge_adjacent_descriptors
from hybrid_pd.connector.vllm.nixl_progress import throttle_progress_thread
from hybrid_pd.connector.vllm.nixl_trace import record_transfers
from hybrid_pd.connector.vllm.pull_await import await_transfers, awaits, posted_since
from hybrid_pd.connector.vllm.pushes import held_key
from hybrid_pd.connector.vllm.scheduler_hold import WAIT, PushInbox, SchedulerHold
from hybrid_pd.connector.vllm.state_pull_hit import apply as pull_state_under_local_hits
from hybrid_pd.connector.vllm.timeline_engine import EngineTimeline

__all__ = ["NixlConnector", "TESTED_VLLM_VERSIONS"]

TESTED_VLLM_VERSIONS = frozenset({"0.32.0"})

# Under vLLM's logger, so these lines carry its format and process prefix.
log = logging.getLogger("vllm.hybrid_pd.connector")

# Whether this vLLM lets a connector report a failed pull of a hybrid model's state
# (``KVConnectorTransferResults.failed_recving``, 0.32; 0.26 has only block-level errors,
# which its scheduler cannot map to a request with several KV cache groups).
REPORTS_FAILED_PULLS = reports_failed_pulls()

# What the worker decided at start (hybrid_pd.connector.vllm.capabilities): {piece: "vllm" | "fallback:<how>"}.
CAPABILITIES: dict[str, str] = json.loads(os.environ.get(CAPABILITIES_ENV) or "{}")
# The fallback for a vLLM that cannot report a failed pull: a pull that would start with less than
# this much of the prefill's lease left recomputes locally instead (a stall during a pull is not caught).
PULL_START_MARGIN_S = 5.0
_CHECK_LEASE_BEFORE_PULL = CAPABILITIES.get(FAILED_PULLS) == "fallback:lease-checked-before-pull"
# How long the decode worker waits for the pulls it posted in a step to complete within it (0: not at all).
PULL_AWAIT_S = int(os.environ.get(AWAIT_ENV) or 0) / 1e6
_capability_gauge = None  # hybrid_pd:capability, registered by the first build_prom_metrics in this process

# The attribute of vLLM's connector metadata that carries lease ends from the decode
# worker's scheduler to its model workers (possibly other processes: it is pickled along).
_LEASE_EXPIRY_ATTR = "hybrid_pd_lease_expiry"
# Likewise whether the workers wait for the pulls this step posts (pull_await.awaits: the step runs no model).
_AWAITS_ATTR = "hybrid_pd_awaits_pulls"


if os.environ.get(DELAY_ENV):
    throttle_progress_thread(int(os.environ[DELAY_ENV]))
if os.environ.get(MERGE_ENV):
    merge_adjacent_descriptors()
if os.environ.get(TRACE_ENV):  # outermost, so the trace holds what vLLM posts, before any merge
    record_transfers(os.environ[TRACE_ENV])
if os.environ.get(TEST_ONLY_DISABLE_ENV) == "1" and remove_vllm_fix():
    log.error(
        "%s=1: TEST ONLY, vLLM's decode-row reclassification is removed in this process; with FULL CUDA graphs this "
        "decode worker answers wrongly. Never set it outside the negative control.", TEST_ONLY_DISABLE_ENV,
    )
if hasattr(NixlPullConnectorScheduler, "_get_remote_prefill_token_count"):  # what remote_prefill_tokens asks
    pull_state_under_local_hits()
if CAPABILITIES.get(DECODE_ROW) == "fallback:connector" and apply_fix():
    log.warning("FALLBACK: hybrid-pd's connector applies its copy of vLLM's decode-row reclassification of token N "
                "(decided at worker start: %s)", CAPABILITIES_ENV)


class _MambaOnlyWorker(NixlPullConnectorWorker):
    """vLLM's pull worker, able to build remote descriptors without an attention group."""

    def _build_fa_remote(self, plan, nixl_agent_meta, block_size_ratio):  # noqa: ANN001, ANN202 - vLLM's signature
        real = self._group_spec_types
        self._group_spec_types = (AttentionSpec, *real[1:])  # group 0 (Mamba) gives the source ranks
        try:
            return super()._build_fa_remote(plan, nixl_agent_meta, block_size_ratio)
        finally:
            self._group_spec_types = real


class NixlConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull), with the pure-Mamba handshake fix and the lease check."""

    _timeline: EngineTimeline | None = None  # set in __init__ when the worker records the hand-off timeline
    _outbox: Outbox | None = None  # prefill scheduler: pushes to the decode workers of early legs
    _hold: SchedulerHold | None = None  # decode scheduler: early legs held until their push (scheduler_hold)

    def __init__(self, vllm_config, role, kv_cache_config) -> None:  # noqa: ANN001 - vLLM's signature
        with kept_affinity("vLLM's NIXL connector worker"):
            super().__init__(vllm_config, role, kv_cache_config)
        self._lease_s = float(vllm_config.kv_transfer_config.get_from_extra_config("kv_lease_duration", 30))
        self._allocated_expiry: dict[str, float] = {}  # decode scheduler: pulls not yet handed to the workers
        self._pull_expiry: dict[str, float] = {}  # decode worker: pulls in flight
        self._fresh_pulls: list[int] = []  # decode worker: NIXL handles posted in a step the scheduler said to await
        if (writer := timeline_writer()) is not None:
            self._timeline = EngineTimeline(writer, prefill=vllm_config.kv_transfer_config.kv_role == "kv_producer")
        if self.connector_scheduler is not None and vllm_config.kv_transfer_config.kv_role in ("kv_producer", "kv_both"):
            self._outbox = Outbox()
        inbox = os.environ.get(HANDOFF_INBOX_ENV)  # set: early legs wait in this scheduler
        if self.connector_scheduler is not None and vllm_config.kv_transfer_config.kv_role in ("kv_consumer", "kv_both") and inbox:
            self._hold = SchedulerHold(PushInbox(urlsplit(inbox).port), WAIT_LIMIT_S)
            log.info("early decode legs wait in vLLM's scheduler for their push to this engine's inbox, %s", inbox)
        if self.connector_worker is not None and vllm_config.kv_transfer_config.kv_role in ("kv_consumer", "kv_both") and not REPORTS_FAILED_PULLS:
            log.warning(
                "this vLLM cannot report a failed pull of hybrid state (no KVConnectorTransferResults.failed_recving; "
                "vLLM 0.32 has it): a pull that completes after the prefill's KV lease ran out is not detected and "
                "would be answered from reused blocks"
            )
        if self.connector_worker is None or any(_is_attention_spec(t) for t in self.connector_worker._group_spec_types):
            return
        if vllm_version() not in TESTED_VLLM_VERSIONS:
            raise RuntimeError(
                f"P/D of a model without attention layers needs hybrid_pd.connector.vllm.nixl_connector's handshake fix, tested "
                f"with vLLM {sorted(TESTED_VLLM_VERSIONS)}, not {vllm_version()}: check that vLLM's "
                "_build_fa_remote still needs it, then add the version"
            )
        self.connector_worker.__class__ = _MambaOnlyWorker  # adds a method, no state

    # Prefill, scheduler side: the answer's kv_transfer_params say when the lease runs out.
    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201 - vLLM's signature
        started_at = time.time()
        self._ending(request)
        delay_free, params = super().request_finished(request, block_ids)
        return self._finished(request, delay_free, params, started_at)

    def request_finished_all_groups(self, request, block_ids):  # noqa: ANN001, ANN201 - vLLM's signature
        started_at = time.time()
        self._ending(request)
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        return self._finished(request, delay_free, params, started_at)

    def _ending(self, request) -> None:  # noqa: ANN001 - vLLM's Request
        """Before vLLM's connector sees a request end: the timeline's note, and a leg still held in the scheduler given its
        push's parameters (the prefill's blocks are freed) or none (vLLM's connector would fail on a prefill not located)."""
        if self._timeline is not None:
            self._timeline.finished(request)
        if self._hold is not None and (key := held_key(request.kv_transfer_params)) is not None:
            request.kv_transfer_params = self._hold.ended(request.request_id, key, request.kv_transfer_params)

    def _finished(self, request, delay_free: bool, params, started_at: float):  # noqa: ANN001, ANN202 - vLLM's types
        """What ``request_finished`` answers: a held state's parameters stamped with the lease, pushed to an early leg's decode worker."""
        if not delay_free:
            return delay_free, params
        params = stamp_lease(params, self._lease_s, started_at)
        asked = request.kv_transfer_params or {}
        if self._outbox is not None and params and isinstance(asked.get(HANDOFF_URL_PARAM), str) and isinstance(asked.get(HANDOFF_KEY_PARAM), str):
            self._outbox.push(asked[HANDOFF_URL_PARAM], asked[HANDOFF_KEY_PARAM], params)
        return delay_free, params

    # Decode, scheduler side. The shortest prompts (LOCAL_PROMPT_TOKENS, hybrid_pd.connector.plan says why) are
    # computed here from scratch, as colocated does, instead of pulled; vLLM tells the prefill to free
    # its blocks at once (its path for a local prefix hit).
    # On a vLLM that cannot report a failed pull (fallback): state whose lease runs out before the pull
    # could complete is not pulled; vLLM prefills the prompt locally.
    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201 - vLLM's signature
        if self._timeline is not None:
            self._timeline.seen(request)
        params = request.kv_transfer_params
        if self._hold is not None and (key := held_key(params)) is not None:  # an early leg held here until its push comes
            outcome = self._hold.look(request.request_id, key, params)
            if outcome is WAIT:
                return None, False  # vLLM keeps it waiting and asks again next step
            params, pushed_at = outcome
            request.kv_transfer_params = params  # the push merged in; None: none came, the prompt is computed here
            if self._timeline is not None and pushed_at is not None:
                self._timeline.handoff_taken(request, pushed_at)
        if params and params.get("do_remote_prefill") and request.num_prompt_tokens <= LOCAL_PROMPT_TOKENS:
            log.info("%s: a prompt of %d token(s) is computed here, not pulled", request.request_id, request.num_prompt_tokens)
            return 0, False
        if _CHECK_LEASE_BEFORE_PULL and params and params.get("do_remote_prefill"):
            expires_at = lease_expiry(params)
            if pull_outlived_lease(expires_at, time.time(), margin_s=PULL_START_MARGIN_S):
                log.warning(
                    "%s: less than %.0f s of the prefill's KV lease left before the pull; recomputing the prompt "
                    "locally", request.request_id, PULL_START_MARGIN_S,
                )
                return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def remote_prefill_tokens(self, request) -> int:  # noqa: ANN001 - vLLM's Request
        """Decode, scheduler side: the prompt tokens a P/D request pulls from its prefill (N-1; fewer with MTP's lookahead)."""
        return self.connector_scheduler._get_remote_prefill_token_count(len(request.prompt_token_ids or ()))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # noqa: ANN001, ANN206 - vLLM's signature
        """vLLM's NIXL metrics, plus ``hybrid_pd:capability{capability,state}`` = 1 for what the worker decided at start."""
        from prometheus_client import Gauge

        global _capability_gauge
        metrics = super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        if CAPABILITIES and _capability_gauge is None:  # once per process: a second registration would raise
            _capability_gauge = metric_types[Gauge](
                name="hybrid_pd:capability",
                documentation="What hybrid P/D needs from vLLM, as probed at worker start: vllm (vLLM has it) or the fallback applied.",
                labelnames=["capability", "state"],
                multiprocess_mode="mostrecent",
            )
            for name, state in CAPABILITIES.items():
                _capability_gauge.labels(capability=name, state=state).set(1)
        return metrics

    # Decode, scheduler side: the lease end of each pull goes to the workers with the pull itself.
    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201 - vLLM's signature
        params = request.kv_transfer_params
        # Only where vLLM asks for transfer results: elsewhere nothing would ever take them out again.
        expires_at = lease_expiry(params) if REPORTS_FAILED_PULLS and params and params.get("do_remote_prefill") else None
        if expires_at is not None:
            self._allocated_expiry[request.request_id] = expires_at
        if self._timeline is not None and num_external_tokens > 0 and params and params.get("do_remote_prefill"):
            self._timeline.pull_queued(request)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201 - vLLM's signature
        if self._timeline is not None:
            self._timeline.step(getattr(scheduler_output, "num_scheduled_tokens", {}))
        if self._hold is not None:
            self._hold.step_ended()
        meta = super().build_connector_meta(scheduler_output)
        setattr(meta, _LEASE_EXPIRY_ATTR, self._allocated_expiry)
        setattr(meta, _AWAITS_ATTR, awaits(PULL_AWAIT_S, scheduler_output.total_num_scheduled_tokens))
        self._allocated_expiry = {}
        return meta

    # Decode, worker side: a pull noticed complete after the lease ran out counts as failed.
    def bind_connector_metadata(self, connector_metadata) -> None:  # noqa: ANN001 - vLLM's signature
        super().bind_connector_metadata(connector_metadata)
        self._pull_expiry.update(getattr(connector_metadata, _LEASE_EXPIRY_ATTR, {}))

    def get_transfer_results(self, finished_req_ids):  # noqa: ANN001, ANN201 - vLLM's signature
        self._await_fresh_pulls()
        results = super().get_transfer_results(finished_req_ids)
        now = time.time()
        for req_id in results.finished_recving:
            expires_at = self._pull_expiry.pop(req_id, None)
            if req_id not in results.failed_recving and pull_outlived_lease(expires_at, now):
                log.warning(
                    "pull of %s completed %.1f s after the prefill's KV lease ran out: its blocks may hold another "
                    "request's state; recomputing the prompt locally", req_id, now - expires_at,
                )
                results.failed_recving.add(req_id)
        for req_id in finished_req_ids:  # aborted before their pull completed
            self._pull_expiry.pop(req_id, None)
        if self._timeline is not None:
            self._timeline.pulled(results.finished_recving, results.failed_recving)
        return results

    # Decode, worker side: the pulls posted in this step (awaited where the scheduler said so), for the
    # timeline too, and (on a vLLM without get_transfer_results) pulls noticed complete.
    def start_load_kv(self, forward_context, **kwargs) -> None:  # noqa: ANN001, ANN003 - vLLM's signature
        awaited = getattr(getattr(self, "_connector_metadata", None), _AWAITS_ATTR, False)
        before = self._transfer_handles() if awaited else None
        super().start_load_kv(forward_context, **kwargs)
        if before is not None:
            self._fresh_pulls += posted_since(before, self._transfer_handles())
        if self._timeline is not None:
            self._timeline.posted(self._pulls_in_flight())

    def get_finished(self, finished_req_ids):  # noqa: ANN001, ANN201 - vLLM's signature
        self._await_fresh_pulls()
        done_sending, done_recving = super().get_finished(finished_req_ids)
        if self._timeline is not None:
            self._timeline.pulled(done_recving or ())
        return done_sending, done_recving

    def _await_fresh_pulls(self) -> None:
        """Before vLLM looks at the pulls in this step: wait (bounded) for the ones this step posted."""
        if self._fresh_pulls:
            handles, self._fresh_pulls = self._fresh_pulls, []
            await_transfers(handles, self.connector_worker.nixl_wrapper.check_xfer_state, PULL_AWAIT_S)

    def _transfer_handles(self) -> dict[str, list[int]]:
        """vLLM's ``_recving_transfers`` (request -> NIXL handles of its reads in flight), copied."""
        transfers = getattr(self.connector_worker, "_recving_transfers", None)
        return {req: list(handles) for req, handles in transfers.items()} if isinstance(transfers, dict) else {}

    def _pulls_in_flight(self) -> list[str]:
        """vLLM ids of the pulls with a NIXL read posted (vLLM's ``_recving_transfers``).

        A vLLM without that map: the pulls handed to this step, posted or waiting for a
        handshake (so a first pull to a new prefill is recorded before its read is posted).
        """
        transfers = getattr(self.connector_worker, "_recving_transfers", None)
        if isinstance(transfers, dict):
            return [req for req, handles in transfers.items() if handles]
        return list(getattr(getattr(self, "_connector_metadata", None), "reqs_to_recv", None) or ())
