"""Our vLLM plugin registered for a vLLM server started from a source tree (``PYTHONPATH``, not installed).

vLLM finds general plugins through the ``vllm.general_plugins`` entry points of installed distributions
(``importlib.metadata``); ``pip install`` writes ours from pyproject.toml. A worker run from a checkout on
``PYTHONPATH`` (the GPU kit of ../shared/gpu: nothing of ours is installed there) has no such metadata, so
vLLM never loaded the plugin and every engine fix our launch named was silently left out (measured
2026-11-28 on two H200s: no server logged a fix). A worker in that case writes the entry point as a
distribution's metadata of its own into a folder and puts it, with the source tree, on the server's
``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from pathlib import Path

import hybrid_pd
from hybrid_pd.connector.vllm import plugin

__all__ = ["ENTRY_POINT", "GROUP", "plugin_path", "register_in", "registered"]

GROUP = "vllm.general_plugins"  # vLLM's (vllm.plugins.DEFAULT_PLUGINS_GROUP), not imported: the worker stays free of vLLM
NAME = "hybrid_pd"  # the entry point's name, as pyproject.toml declares it
ENTRY_POINT = f"{plugin.__name__}:{plugin.load.__name__}"
DIST = "hybrid_pd_vllm_plugin"  # the folder's distribution: not hybrid-pd, whose metadata it would shadow


def registered() -> bool:
    """Whether this interpreter's installed distributions declare our plugin (a pip install of hybrid-pd does)."""
    return any(ep.value == ENTRY_POINT for ep in importlib.metadata.entry_points(group=GROUP))


def register_in(directory: Path) -> Path:
    """Write a distribution's metadata declaring our plugin into ``directory`` (made if missing); ``directory``.

    Written to a temporary name and renamed, so workers starting together never read half a file.
    """
    info = directory / f"{DIST}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    files = {"METADATA": f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0\n", "entry_points.txt": f"[{GROUP}]\n{NAME} = {ENTRY_POINT}\n"}
    for name, text in files.items():
        with tempfile.NamedTemporaryFile("w", dir=info, delete=False) as tmp:
            tmp.write(text)
        os.replace(tmp.name, info / name)
    return directory


def plugin_path(pythonpath: str | None) -> str | None:
    """The ``PYTHONPATH`` (now ``pythonpath``) a vLLM server needs to load our plugin, or None where it loads already (installed).

    The folder is one per user, written again at every start (workers share it);
    the source tree follows it so the plugin's module imports in every process vLLM starts.
    """
    if registered():
        return None
    directory = register_in(Path(tempfile.gettempdir()) / f"hybrid-pd-vllm-plugin-{os.getuid()}")
    source = Path(hybrid_pd.__file__).resolve().parent.parent
    return os.pathsep.join(filter(None, [str(directory), str(source), pythonpath]))
