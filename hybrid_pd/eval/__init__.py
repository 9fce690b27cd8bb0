"""Accuracy evaluation through the OpenAI completions API: is P/D as accurate as colocated?

``hybrid-pd eval gsm8k`` asks one endpoint (and optionally a baseline) the GSM8K test
questions the way lm-eval's ``gsm8k`` task does, scores the answers with the same
``strict-match`` and ``flexible-extract`` filters, and compares the two endpoints.

One job per module:

- :mod:`.data`: the problems (vendored GSM8K, or :mod:`.synthetic` ones).
- :mod:`.prompts`: the k-shot prompt and the stop sequences.
- :mod:`.scoring`: answer extraction and normalisation, as lm-eval does it.
- :mod:`.client`: asking an endpoint every prompt, concurrently (:mod:`.progress` shows how far).
- :mod:`.stats`: confidence intervals.
- :mod:`.report`: summaries, the comparison gate, the text and JSON reports.
- :mod:`.cli`: the ``eval`` subcommand.
"""
