"""Our vLLM plugin: the engine fixes a worker asks for, applied in every process of its vLLM server.

vLLM loads the ``vllm.general_plugins`` entry points (pyproject.toml) in each of its processes
(API server, engine core, model workers) before it builds the model. A plain vLLM server on the
same machine gets nothing: a fix applies only where our launch named it in
``HYBRID_PD_ENGINE_FIXES`` (:mod:`hybrid_pd.connector.launch`), and only where the installed vLLM
still lacks what it fixes (each fix probes first). Unlike our connector module, which only P/D
roles load, the plugin reaches colocated servers too.
"""

from __future__ import annotations

import logging
import os

from hybrid_pd.connector.contract import CPU_PREFIX_CACHING, DETOK_SUFFIX, ENGINE_FIXES_ENV, SHM_SPIN

__all__ = ["load"]

log = logging.getLogger("vllm.hybrid_pd.plugin")


def load() -> None:
    """The entry point: apply each fix ``HYBRID_PD_ENGINE_FIXES`` names that this vLLM needs."""
    fixes = set(filter(None, os.environ.get(ENGINE_FIXES_ENV, "").split(",")))
    if CPU_PREFIX_CACHING in fixes:
        from hybrid_pd.connector.vllm import cpu_prefix_caching

        if (missing := cpu_prefix_caching.probe()) is not None:
            cpu_prefix_caching.apply()
            log.info("hybrid-pd: prefix caching of Mamba2 state on CPU by our torch scan and checkpoint store (%s)", missing)
    if SHM_SPIN in fixes:
        from hybrid_pd.connector.vllm import shm_spin

        if (spinning := shm_spin.probe()) is not None:
            shm_spin.apply()
            log.info("hybrid-pd: %s; each turn sleeps %g us instead, leaving the core to the others", spinning, shm_spin.SPIN_SLEEP_S * 1e6)
    if DETOK_SUFFIX in fixes:
        from hybrid_pd.connector.vllm import detok_suffix

        if (why := detok_suffix.probe()) is not None:
            detok_suffix.apply()
            log.info("hybrid-pd: %s; each stream is primed with the prompt's last %d tokens instead", why, detok_suffix.SUFFIX_TOKENS)
