"""Split 'decode: decode row forward, token N out as the first event' with the probe's per-call records (probe/).

usage: analyze.py PROFDIR TLDIR   (prints one table per prompt length; writes PROFDIR/analysis.json)

The decode worker's processes are found from the records: its engine core is the one whose ``schedule()`` takes new
requests with computed tokens (the pulled state), its model runner runs in that process under vLLM's one-process
executor (one GPU) or in others, and its API server is the one whose ``process_outputs`` carries the request. Every
piece is one call's own duration, or the gap between two calls that belong to the same request for certain: the
decode-row step's ``schedule()``, the ``execute_model`` and ``sample_tokens`` right after it (one engine-loop
iteration), and the first and second ``process_outputs`` that carry the request (its first and second token). Under
vLLM's asynchronous scheduling the step's GPU work, ``update_from_output`` and the trip to the API server overlap the
next step's launch, so they are one gap here ("sample_tokens end -> process_outputs start").
"""
import glob
import json
import os
import statistics as st
import sys

prof, tl = sys.argv[1], sys.argv[2]
recs = {}
for f in glob.glob(f"{prof}/prof-*.jsonl"):
    recs[int(f.split("-")[-1].split(".")[0])] = [json.loads(line) for line in open(f) if line.strip()]


def has(pid, name):
    return any(r["f"] == name for r in recs[pid])


ec = [p for p in recs if any(r["f"] == "Scheduler.schedule" and any(n[2] > 0 for n in r.get("new", ())) for r in recs[p])][0]
wk = [ec] if has(ec, "GPUModelRunner.execute_model") else [p for p in recs if has(p, "GPUModelRunner.execute_model")]
api = [p for p in recs if has(p, "OutputProcessor.process_outputs")]
http, rid_of = {}, {}
for f in glob.glob(f"{tl}/timeline-decode-*.jsonl"):
    for line in open(f):
        e = json.loads(line)
        if e.get("ev") == "http_out":
            http.setdefault(e["rid"], e["mono"])
        if e.get("ev") == "scheduled":
            rid_of.setdefault(e["req"], e["rid"])
allw = sorted((r for p in wk for r in recs[p]), key=lambda r: r["t0"])
alla = sorted((r for p in api for r in recs[p]), key=lambda r: r["t0"])
E = sorted(recs[ec], key=lambda r: r["t0"])


def end(r):
    return r["t0"] + r["d"] / 1e3


def first(rs, name, after, pred=lambda r: True):
    return next((r for r in rs if r["f"] == name and r["t0"] >= after and pred(r)), None)


def within(rs, name, outer):
    r = first(rs, name, outer["t0"])
    return r["d"] if r and r["t0"] < end(outer) else 0.0


rows = []
for s in E:
    if s["f"] != "Scheduler.schedule" or not any(n[2] > 0 for n in s.get("new", ())):
        continue
    req, plen, _ = [n for n in s["new"] if n[2] > 0][0]
    rid = rid_of.get(req)
    if rid not in http:
        continue
    T = s["t0"]
    em = first(allw, "GPUModelRunner.execute_model", T)
    stp = first(allw, "GPUModelRunner.sample_tokens", em["t0"]) if em else None
    carries = lambda r: req in r.get("reqs", ())  # noqa: E731
    po = first(alla, "OutputProcessor.process_outputs", T, carries)
    po2 = first(alla, "OutputProcessor.process_outputs", end(po), carries) if po else None
    if not (em and stp and po):
        continue
    em2 = first(allw, "GPUModelRunner.execute_model", end(stp))  # the next step, launched while this one runs
    ms = lambda t: (t - T) * 1e3  # noqa: E731
    rows.append({
        "plen": plen,
        "schedule() of the decode-row step": s["d"],
        "  of which the pulled request readied (_update_waiting_for_remote_kv)": sum(
            r["d"] for r in E if r["f"] == "Scheduler._update_waiting_for_remote_kv" and T <= r["t0"] <= end(s)),
        "schedule end -> execute_model start": ms(em["t0"]) - s["d"],
        "execute_model (CPU: inputs prepared, graphs launched)": em["d"],
        "  of which _update_states": within(allw, "GPUModelRunner._update_states", em),
        "  of which InputBatch.add_request": within(allw, "InputBatch.add_request", em),
        "  of which _prepare_inputs": within(allw, "GPUModelRunner._prepare_inputs", em),
        "execute_model end -> sample_tokens end": ms(end(stp)) - ms(end(em)),
        "sample_tokens end -> process_outputs start (GPU step, update_from_output, to the API server)": ms(po["t0"]) - ms(end(stp)),
        "process_outputs (first token: detokenizer primed with the prompt)": po["d"],
        "process_outputs end -> first SSE event written": ms(http[rid]) - ms(end(po)),
        "TOTAL decode-row step scheduled -> first event": ms(http[rid]),
        "next step: execute_model": em2["d"] if em2 else None,
        "second token: process_outputs": po2["d"] if po2 else None,
        "first token's process_outputs end -> second's start (the ITL)": (po2["t0"] - end(po)) * 1e3 if po2 else None,
    })


def med(rs, k):
    v = [r[k] for r in rs if r.get(k) is not None]
    return (round(st.median(v), 3), round(st.mean(v), 3)) if v else (None, None)


out = {}
for plen in sorted({r["plen"] for r in rows}):
    rs = [r for r in rows if r["plen"] == plen]
    out[plen] = {k: med(rs, k) for k in rs[0] if k != "plen"}
    print(f"{len(rs)} decode-row steps, prompt {plen} tokens (decode engine core pid {ec}, model runner {wk}, API servers {api})")
    print(f"{'ms':92s} {'p50':>8s} {'mean':>8s}")
    for k, (p50, mean) in out[plen].items():
        print(f"{k:92s} {p50 if p50 is not None else float('nan'):8.3f} {mean if mean is not None else float('nan'):8.3f}")
    print()
json.dump(out, open(os.path.join(prof, "analysis.json"), "w"), indent=1)
