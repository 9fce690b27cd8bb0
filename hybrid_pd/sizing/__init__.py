"""Cluster sizing: how many GPUs, and split how, for a traffic and its latency targets (issue #29).

``hybrid-pd profile`` measures a model's serving profile on one GPU (one running server);
``hybrid-pd size`` reads it, simulates every layout of the GPUs (colocated replicas, flexible
workers as replicas, every xPyD split) under the traffic, and predicts goodput per GPU, throughput, TTFT and TPOT for each.

One job per module:

- :mod:`.profile`: the profile, one JSON file: a worker's step time, latencies, transfer and memory.
- :mod:`.workload`: the traffic (lengths, closed-loop concurrency or Poisson rate) as seeded requests.
- :mod:`.layouts`: the layouts of a number of GPUs.
- :mod:`.engine`: one vLLM worker's continuous batching (token budget, max-num-seqs, memory).
- :mod:`.simulate`: the discrete-event simulation of client, router and workers, and its summary.
- :mod:`.report`: the predictions as a table, JSON and a plot of goodput per GPU against GPUs.
- :mod:`.fitting`: how each profile quantity is fitted to measurements, whichever they are.
- :mod:`.matrix`: a profile fitted from the real-scale goodput matrix (``python -m hybrid_pd.sizing.matrix``).
- :mod:`.check`: the simulator's predictions against that matrix, row by row.
- :mod:`.measure`: what ``hybrid-pd profile`` measures of one running server.
- :mod:`.profiler`: the profile's measurement plan, shaped to a server, and its fit.
- :mod:`.projection`: the matrix's workloads projected to 8, 16 and 64 GPUs (docs/sizing.md).
- :mod:`.cli`: the ``size`` subcommand; :mod:`.profile_cli`: the ``profile`` subcommand.
"""
