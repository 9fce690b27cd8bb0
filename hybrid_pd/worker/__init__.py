"""The worker: one vLLM server, in one of three roles, started and watched by ``hybrid-pd <role>``.

- ``prefill``: produces state (NIXL ``kv_producer``). It runs each prompt up to token
  N-1 and holds h(N-1) (the conv and SSM state of every Mamba layer, plus the attention
  KV) until the decode worker pulls it.
- ``decode``: consumes state (NIXL ``kv_consumer``). It pulls h(N-1) from the prefill
  worker, recomputes token N as a decode row and generates the answer.
- ``flex``: both (NIXL ``kv_both``). It serves a request whole, as a colocated replica does,
  prefills one for another worker, or decodes one another worker prefilled: the router
  decides per request from live load and its SLOs (:mod:`hybrid_pd.router.decider`).
- ``colocated``: a plain vLLM server without a connector, the baseline P/D is compared to.

:mod:`hybrid_pd.worker.settings` declares the settings (flags and environment alike),
:mod:`hybrid_pd.worker.run` runs the server, :mod:`hybrid_pd.worker.registration` keeps it
registered with a router. What each role means to vLLM is :mod:`hybrid_pd.connector.launch`'s job.
"""

from __future__ import annotations

from hybrid_pd.connector.launch import Role

__all__ = ["ROLES"]

# Each role's one-line summary: the help of its ``hybrid-pd`` subcommand.
ROLES: dict[Role, str] = {
    "prefill": "run a prefill worker (vLLM + NIXL connector)",
    "decode": "run a decode worker (vLLM + NIXL connector)",
    "flex": "run a flexible worker: prefills, decodes or both, as the router decides per request (vLLM + NIXL connector)",
    "colocated": "run a plain vLLM server (the baseline P/D is compared to)",
}
