"""Ports for our services: free, distinct, and never from the range the kernel hands out on its own."""

import socket

from hybrid_pd.common.processes import _ephemeral_ports, free_port


def test_ports_are_free_distinct_and_outside_the_ephemeral_range():
    ephemeral = _ephemeral_ports()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert not any(p in ephemeral for p in ports), "a port the kernel may give any process's next socket"
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
