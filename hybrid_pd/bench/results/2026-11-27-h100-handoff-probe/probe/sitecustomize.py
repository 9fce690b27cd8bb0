"""Probe (issue #35): time vLLM's functions on the decode-row path, one JSON line per call, per process.

A measurement tool of this run, not a part of the service: loaded through PYTHONPATH (so every Python process of the
run imports it), it wraps the methods named in _TARGETS right after their modules are imported, and is active only
when HANDOFF_PROBE_DIR is set. Timestamps are time.monotonic() (system-wide on Linux: comparable across processes).
HANDOFF_PROBE_DETOK_SUFFIX=1 also primes vLLM's detokenizer with a bounded prompt suffix instead of the whole prompt:
the A/B of that cut on CPU (docs/performance.md).
"""
import importlib.abc, importlib.machinery, json, os, sys, time, functools

_DIR = os.environ.get("HANDOFF_PROBE_DIR")
_TARGETS = {
    "vllm.v1.core.sched.scheduler": [("Scheduler", "schedule"), ("Scheduler", "update_from_output"),
                                     ("Scheduler", "_update_waiting_for_remote_kv"), ("Scheduler", "add_request")],
    "vllm.v1.core.kv_cache_manager": [("KVCacheManager", "cache_blocks"), ("KVCacheManager", "allocate_slots")],
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner", "_update_states"), ("GPUModelRunner", "execute_model"),
                                        ("GPUModelRunner", "sample_tokens"), ("GPUModelRunner", "_prepare_inputs"),
                                        ("GPUModelRunner", "_bookkeeping_sync"), ("GPUModelRunner", "_model_forward"),
                                        ("AsyncGPUModelRunnerOutput", "get_output")],
    "vllm.v1.worker.gpu_input_batch": [("InputBatch", "add_request"), ("InputBatch", "refresh_metadata")],
    "vllm.v1.engine.core": [("EngineCore", "step"), ("EngineCore", "step_with_batch_queue"),
                            ("EngineCore", "post_step")],
    "vllm.v1.engine.output_processor": [("OutputProcessor", "process_outputs")],
    "hybrid_pd.connector.vllm.nixl_connector": [
        ("NixlConnector", "get_finished"), ("NixlConnector", "start_load_kv"), ("NixlConnector", "build_connector_meta"),
        ("NixlConnector", "update_state_after_alloc"), ("NixlConnector", "request_finished"),
        ("NixlConnector", "bind_connector_metadata"), ("NixlConnector", "get_transfer_results")],
}
_fh = None

def _out(rec):
    global _fh
    if _fh is None:
        _fh = open(os.path.join(_DIR, f"prof-{os.getpid()}.jsonl"), "a", buffering=1)
    _fh.write(json.dumps(rec) + "\n")

def _extra(name, args, result):
    try:
        if name == "Scheduler.schedule" and result is not None:
            new = [(r.req_id, len(r.prompt_token_ids or ()), r.num_computed_tokens) for r in result.scheduled_new_reqs]
            return {"new": new, "ntok": result.total_num_scheduled_tokens, "nreq": len(result.num_scheduled_tokens)}
        if name == "InputBatch.add_request":
            r = args[1]
            return {"req": r.req_id, "plen": len(r.prompt_token_ids or ())}
        if name == "KVCacheManager.cache_blocks" or name == "Scheduler._update_waiting_for_remote_kv":
            r = args[1]
            return {"req": r.request_id, "plen": r.num_prompt_tokens}
        if name == "OutputProcessor.process_outputs":
            return {"reqs": [o.request_id for o in args[1]][:8], "n": len(args[1])}
    except Exception as e:  # noqa
        return {"err": repr(e)}
    return None

# HANDOFF_PROBE_PROFILE=N (2026-11-29-cpu-held-legs): a cProfile of the first N schedule() calls with 32+ requests waiting
# and one running, written to $HANDOFF_PROBE_DIR/schedule-<pid>.pstats.
_PROFILE = {"left": int(os.environ.get("HANDOFF_PROBE_PROFILE") or 0), "prof": None}

def _profiled(qual, args):
    if qual != "Scheduler.schedule" or _PROFILE["left"] <= 0 or len(args[0].waiting) < 32 or not args[0].running:
        return None
    import cProfile
    _PROFILE["prof"] = _PROFILE["prof"] or cProfile.Profile()
    return _PROFILE["prof"]

def _profiled_end(prof):
    prof.disable()
    _PROFILE["left"] -= 1
    if _PROFILE["left"] == 0:
        prof.dump_stats(os.path.join(_DIR, f"schedule-{os.getpid()}.pstats"))

def _wrap(cls, meth, qual):
    fn = cls.__dict__.get(meth) or getattr(cls, meth, None)
    if fn is None or getattr(fn, "_probe", False):
        return
    @functools.wraps(fn)
    def w(*args, **kw):
        # what waited and ran as the scheduler began its step (2026-11-29-cpu-held-legs: legs held in it)
        before = {"waiting": len(args[0].waiting), "running": len(args[0].running)} if qual == "Scheduler.schedule" else None
        prof = _profiled(qual, args)
        if prof is not None:
            prof.enable()
        t0 = time.monotonic()
        try:
            res = fn(*args, **kw)
            return res
        finally:
            t1 = time.monotonic()
            if prof is not None:
                _profiled_end(prof)
            rec = {"f": qual, "t0": t0, "d": (t1 - t0) * 1e3, **(before or {})}
            try:
                ex = _extra(qual, args, locals().get("res"))
            except Exception:
                ex = None
            if ex:
                rec.update(ex)
            _out(rec)
    w._probe = True
    setattr(cls, meth, w)

def _patch(mod):
    for cname, meth in _TARGETS.get(mod.__name__, ()):
        cls = getattr(mod, cname, None)
        if cls is not None:
            _wrap(cls, meth, f"{cname}.{meth}")

class _Loader(importlib.abc.Loader):
    def __init__(self, inner): self.inner = inner
    def create_module(self, spec): return self.inner.create_module(spec)
    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        for f in sys.meta_path:
            if f is self:
                continue
            spec = getattr(f, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None

if _DIR:
    sys.meta_path.insert(0, _Finder())


# --- A/B of the proposed cut: prime the detokenizer's DecodeStream with a bounded prompt suffix
# (what vLLM did before its "native prefill"), not the whole prompt. On with HANDOFF_PROBE_DETOK_SUFFIX=1.
def _patch_detok(mod):
    import tokenizers
    cls = mod.FastIncrementalDetokenizer
    orig = cls.__init__
    def __init__(self, tokenizer, request):
        orig(self, tokenizer, request)
        ids = request.prompt_token_ids or []
        suffix = ids
        if len(ids) > 4:
            for i in range(4, min(len(ids) + 1, 24)):
                cand = ids[-i:]
                if "\ufffd" not in self.tokenizer.decode(cand):
                    suffix = cand
                    break
            else:
                suffix = ids[-24:]
        self.stream = tokenizers.decoders.DecodeStream(ids=list(suffix), skip_special_tokens=self.skip_special_tokens)
    cls.__init__ = __init__

if _DIR and os.environ.get("HANDOFF_PROBE_DETOK_SUFFIX") == "1":
    _TARGETS.setdefault("vllm.v1.engine.detokenizer", [])
    _orig_patch = _patch
    def _patch(mod):  # noqa: F811
        _orig_patch(mod)
        if mod.__name__ == "vllm.v1.engine.detokenizer":
            _patch_detok(mod)
