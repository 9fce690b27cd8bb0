"""Every call the probe timed, per process and function: count, p50, mean, sum (ms). ``python3 per_call.py PROBE_DIR``.

The probe (``probe/sitecustomize.py``) writes one JSON line per call into ``prof-PID.jsonl``; ``analyze.py`` follows
the decode-row steps, this compares whole processes (a P/D decode worker's steps against a colocated server's).
"""
import collections
import glob
import json
import os
import statistics
import sys

for path in sorted(glob.glob(os.path.join(sys.argv[1], "prof-*.jsonl"))):
    calls = collections.defaultdict(list)
    with open(path) as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short when the process was killed
                continue
            calls[record["f"]].append(record["d"])
    if calls:
        print(f"pid {path.rsplit('-', 1)[1].split('.')[0]}")
        for name, ms in sorted(calls.items()):
            print(f"   {name:45s} n={len(ms):6d} p50={statistics.median(ms):8.3f} mean={statistics.mean(ms):8.3f} ms  sum={sum(ms):9.1f}")
