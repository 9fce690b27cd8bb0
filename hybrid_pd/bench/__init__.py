"""Serving benchmark through the OpenAI completions API: latency and throughput of P/D against a baseline.

``hybrid-pd bench`` sends prompts of exactly ``--input-len`` random token ids to an endpoint
(and a baseline, at every load level right after it, with the same prompts), streams
``--output-len`` tokens back for each, and reports TTFT, ITL, end-to-end latency, throughput
and goodput under latency SLOs.

One job per module:

- :mod:`.prompts`: seeded random token-id prompts inside the model's vocabulary.
- :mod:`.client`: one streamed (or JSON) completion request, timed.
- :mod:`.runner`: a load level (fixed concurrency or Poisson arrival rate) against one target,
  and the whole interleaved run.
- :mod:`.stats`: percentiles, summaries and goodput.
- :mod:`.report`: the text table and the JSON report.
- :mod:`.plot`: latency against load as a PNG (optional: needs matplotlib).
- :mod:`.timeline`: the hand-off timeline's traces joined into per-request segments.
- :mod:`.budget`: those segments as a budget table per load level (``--timeline``).
- :mod:`.cli`: the ``bench`` subcommand.
"""
