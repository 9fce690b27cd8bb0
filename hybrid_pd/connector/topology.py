"""What this host offers the state transfer: its active RDMA ports.

:func:`hybrid_pd.connector.launch.ucx_env` turns it into UCX settings. Read from sysfs, so
it costs nothing and needs no RDMA library.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["rdma_devices"]

SYSFS_INFINIBAND = Path("/sys/class/infiniband")


def rdma_devices(root: Path = SYSFS_INFINIBAND) -> tuple[str, ...]:
    """Active RDMA ports as UCX names them (``mlx5_0:1``), sorted; empty when there are none.

    A port counts when its ``state`` reads ``ACTIVE`` (``4: ACTIVE`` in sysfs), on
    InfiniBand and RoCE alike.
    """
    if not root.is_dir():
        return ()
    found = []
    for device in sorted(root.iterdir()):
        ports = device / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            try:
                state = (port / "state").read_text()
            except OSError:
                continue
            if state.split(":")[-1].strip().upper().startswith("ACTIVE"):
                found.append(f"{device.name}:{port.name}")
    return tuple(found)
