"""Run 2's prefill engines step by step, from the probe every process loaded (PROBE=1 in ../run.sh; its per-call records,
48 MB, are not kept): in the window of each engine's c8 runs, the steps that computed tokens, their prompts and tokens,
and the time from one such step's schedule() to the next (prefill-steps.json). Engine pids from the servers' logs:
pre (asynchronous scheduling, vLLM's default) 2069, presync (--no-async-scheduling) 1993. Run in the run's folder."""
import json
import statistics as st


def load(pid):
    recs=[json.loads(l) for l in open(f'probe/prof-{pid}.jsonl')]
    return recs
out={}
for name,pid,prefix in [('prefill, async (vLLM default)',2069,('cmpl-ded-c8','cmpl-dedb-c8')),('prefill, --no-async-scheduling',1993,('cmpl-sync-c8','cmpl-syncb-c8'))]:
    recs=load(pid)
    sch=[r for r in recs if r['f']=='Scheduler.schedule']
    ex=[r for r in recs if r['f']=='GPUModelRunner.execute_model']
    # windows: first and last schedule call that has a new request of the runs
    ts=[r['t0'] for r in sch if any(n[0].startswith(prefix) for n in r.get('new',[]))]
    lo,hi=min(ts),max(ts)
    s=[r for r in sch if lo<=r['t0']<=hi+0.5]
    work=[r for r in s if r.get('ntok',0)>0]
    e=[r for r in ex if lo<=r['t0']<=hi+0.5]
    starts=[r['t0'] for r in work]
    gaps=[(b-a)*1e3 for a,b in zip(starts,starts[1:])]
    nreq=[r['nreq'] for r in work]; ntok=[r['ntok'] for r in work]
    ed=[r['d'] for r in e]
    print(name, 'window %.1f s'%(hi-lo), 'steps with tokens', len(work), 'empty schedules', len(s)-len(work),
          'tokens/step p50', st.median(ntok), 'prompts/step mean %.2f'%st.fmean(nreq),
          'schedule-to-schedule p50 %.1f ms mean %.1f'%(st.median(gaps), st.fmean(gaps)), 'execute_model (CPU) p50 %.1f ms'%st.median(ed))
    out[name]={"window_s":hi-lo,"steps":len(work),"empty_schedules":len(s)-len(work),"tokens_per_step_p50":st.median(ntok),"prompts_per_step_mean":st.fmean(nreq),
               "step_to_step_ms_p50":st.median(gaps),"step_to_step_ms_mean":st.fmean(gaps),"execute_model_ms_p50":st.median(ed)}
json.dump(out, open('prefill-steps.json', 'w'), indent=1)
