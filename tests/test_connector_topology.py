"""The host's RDMA ports, read from a sysfs tree."""

from pathlib import Path

from hybrid_pd.connector.topology import rdma_devices


def _port(root: Path, device: str, port: str, state: str) -> None:
    d = root / device / "ports" / port
    d.mkdir(parents=True)
    (d / "state").write_text(state + "\n")


def test_active_ports_in_ucx_naming_and_others_skipped(tmp_path):
    _port(tmp_path, "mlx5_1", "1", "4: ACTIVE")
    _port(tmp_path, "mlx5_0", "1", "4: ACTIVE")
    _port(tmp_path, "mlx5_0", "2", "1: DOWN")
    _port(tmp_path, "mlx5_2", "1", "2: INIT")
    (tmp_path / "irdma0").mkdir()  # a device without ports
    assert rdma_devices(tmp_path) == ("mlx5_0:1", "mlx5_1:1")


def test_no_rdma_on_this_host(tmp_path):
    assert rdma_devices(tmp_path / "absent") == ()
    assert rdma_devices(tmp_path) == ()
