"""Reading a NIXL trace back: descriptors as offsets into the regions both sides registered."""

import json

import pytest

from hybrid_pd.connector.vllm.nixl_trace import Descriptor, load_trace

D, P = 0x1000_0000, 0x7000_0000


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def _registrations():
    return [
        {"event": "agent", "name": "decode", "pid": 1},
        {"event": "register", "agent": "decode", "mem_type": "VRAM", "regions": [[D, 1 << 20, 0], [D + (2 << 20), 1 << 20, 0]]},
        {"event": "register", "agent": "prefill", "mem_type": "VRAM", "regions": [[P + (4 << 20), 1 << 20, 0], [P, 1 << 20, 0]]},
    ]


def test_transfers_become_region_offsets_and_touched_sizes(tmp_path):
    xfer = {"event": "xfer", "agent": "decode", "op": "READ", "remote_agent": "prefill",
            "local": [[D + 4096, 4096], [D + (2 << 20), 8192]], "remote": [[P + 8192, 4096], [P + (4 << 20) + 100, 8192]]}  # fmt: skip
    _write(tmp_path / "nixl-1.jsonl", _registrations()[:2] + [xfer])
    _write(tmp_path / "nixl-2.jsonl", _registrations()[2:])
    trace = load_trace(tmp_path)
    assert trace.mem_type == "VRAM" and trace.op == "READ"
    assert trace.transfers == ((Descriptor(0, 4096, 0, 8192, 4096), Descriptor(1, 0, 1, 100, 8192)),)
    assert trace.local_region_bytes == (8192, 8192)
    assert trace.remote_region_bytes == (12288, 8292)


def test_busiest_initiator_and_peer_are_kept(tmp_path):
    one = {"event": "xfer", "agent": "decode", "op": "READ", "remote_agent": "prefill", "local": [[D, 16]], "remote": [[P, 16]]}
    other = {**one, "remote_agent": "elsewhere"}
    _write(tmp_path / "nixl-1.jsonl", _registrations() + [one, one, other])
    assert len(load_trace(tmp_path).transfers) == 2


def test_missing_peer_registration_and_bad_descriptors_are_errors(tmp_path):
    xfer = {"event": "xfer", "agent": "decode", "op": "READ", "remote_agent": "prefill", "local": [[D, 16]], "remote": [[P, 16]]}
    _write(tmp_path / "nixl-1.jsonl", _registrations()[:2] + [xfer])
    with pytest.raises(ValueError, match="trace both workers"):
        load_trace(tmp_path)
    outside = {**xfer, "local": [[D + (1 << 20) - 8, 16]]}
    _write(tmp_path / "nixl-1.jsonl", _registrations() + [outside])
    with pytest.raises(ValueError, match="in no registered region"):
        load_trace(tmp_path)
    _write(tmp_path / "nixl-1.jsonl", _registrations())
    with pytest.raises(ValueError, match="no transfers"):
        load_trace(tmp_path)
