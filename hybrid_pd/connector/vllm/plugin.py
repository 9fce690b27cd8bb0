"""Our vLLM plugin: the engine fixes a worker asks for, applied in every process of its vLLM server.

vLLM loads the ``vllm.general_plugins`` entry points (pyproject.toml) in each of its processes
(API server, engine core, model workers) before it builds the model. A plain vLLM server on the
same machine gets nothing: a fix applies only where our launch named it in
``HYBRID_PD_ENGINE_FIXES`` (:mod:`hybrid_pd.connector.launch`), and only where the installed vLLM
still lacks what it fixes (each fix probes first). Unlike our connector module, which only P/D
roles load, the plugin reaches colocated servers too.
"""

from __future__ import annotations

import importlib
import logging
import os

from hybrid_pd.connector.contract import ENGINE_FIXES, ENGINE_FIXES_ENV

__all__ = ["load"]

log = logging.getLogger("vllm.hybrid_pd.plugin")


def load() -> None:
    """The entry point: apply each fix ``HYBRID_PD_ENGINE_FIXES`` names that this vLLM needs.

    A fix is the module of its name beside this one: ``probe()`` says why this vLLM needs it (None: it does not),
    ``apply()`` puts it in place, ``DOES`` says what it does instead (logged).
    """
    named = set(filter(None, os.environ.get(ENGINE_FIXES_ENV, "").split(",")))
    for name in (fix for fix in ENGINE_FIXES if fix in named):
        fix = importlib.import_module(f"{__package__}.{name}")
        if (why := fix.probe()) is not None:
            fix.apply()
            log.info("hybrid-pd: %s; %s", why, fix.DOES)
