"""vLLM's message-queue spin sleeps instead of yielding the core, where the launch asks (CPU; issue #36).

The starvation it ends and what it costs are measured on a real stack (docs/reliability.md); here, the
swap itself, in vLLM's own module, and only where the plugin is told to make it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from hybrid_pd.connector.contract import ENGINE_FIXES_ENV, SHM_SPIN


def test_the_plugin_swaps_the_spin_of_vllms_message_queues_only_where_the_launch_asks():
    code = (
        "import os, time\n"
        "from hybrid_pd.connector.vllm.plugin import load\n"
        "from vllm.distributed.device_communicators import shm_broadcast\n"
        "from hybrid_pd.connector.vllm import shm_spin\n"
        "load(); print(shm_broadcast.sched_yield.__module__)\n"
        f"os.environ[{ENGINE_FIXES_ENV!r}] = {SHM_SPIN!r}\n"
        "load(); print(shm_broadcast.sched_yield.__module__, shm_spin.probe())\n"
        "start = time.process_time(); began = time.monotonic()\n"
        "while time.monotonic() - began < 0.3:\n"
        "    shm_broadcast.sched_yield()\n"  # what a reader does between looks at the ring
        "print(round(time.process_time() - start, 3))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ENGINE_FIXES_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, cpu = done.stdout.strip().splitlines()[-3:]
    assert before == "vllm.distributed.utils"
    assert after == "hybrid_pd.connector.vllm.shm_spin None"  # swapped, and a second load finds nothing left to swap
    # 0.3 s of spinning holds the core ~0.3 s with sched_yield; sleeping between looks, a fraction of it.
    assert float(cpu) < 0.15, cpu
