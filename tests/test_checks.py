"""The value checks behind every setting's validation accept what users really pass (hybrid_pd/common/checks.py).

tests/test_cli_usage_errors.py shows the refusals through the CLI; this file shows that the
same checks let the ordinary values through, so validation refuses nothing that works.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hybrid_pd.common import checks
from hybrid_pd.common.arg_types import checked


@pytest.mark.parametrize("model", ["", "gpt2", "ibm-granite/granite-4.0-h-tiny", "nvidia/NVIDIA-Nemotron-Nano-9B-v2"])
def test_model_ref_takes_the_default_and_hub_ids(model: str):
    assert checks.model_ref(model) == model


def test_model_ref_takes_existing_paths_and_refuses_missing_ones(tmp_path: Path):
    assert checks.model_ref(str(tmp_path)) == str(tmp_path)
    for missing in (str(tmp_path / "nope"), "./nope", "../nope", "models/a/b", "~/no-such-model-here"):
        with pytest.raises(ValueError, match="no model at"):
            checks.model_ref(missing)


@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("http://router:8000", "http://router:8000"),
        ("https://pd.example.com/", "https://pd.example.com"),
        ("http://10.0.0.2:8000/", "http://10.0.0.2:8000"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://router:8000/prefix", "http://router:8000/prefix"),
    ],
)
def test_http_url_takes_base_urls(url: str, kept: str):
    assert checks.http_url(url) == kept


@pytest.mark.parametrize("url", ["router:8000", "http://", "ftp://router", "http://router:99999", "http://router:x"])
def test_http_url_refuses_what_no_client_can_reach(url: str):
    with pytest.raises(ValueError, match="http://host:port"):
        checks.http_url(url)


def test_numbers_and_ports():
    assert checks.tcp_port(1) == 1 and checks.tcp_port(65535) == 65535 and checks.tcp_port(None) is None
    assert checks.positive(0.001) == 0.001 and checks.not_negative(0) == 0 and checks.fraction(1.0) == 1.0
    for check, bad in ((checks.tcp_port, 0), (checks.positive, 0), (checks.not_negative, -1), (checks.fraction, 0.0)):
        with pytest.raises(ValueError):
            check(bad)


def test_outputs_may_be_in_folders_still_to_make(tmp_path: Path):
    assert checks.output_file(tmp_path / "a" / "b" / "report.json") == tmp_path / "a" / "b" / "report.json"
    assert checks.output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        checks.output_dir(tmp_path / "f" / "sub")


def test_checked_turns_a_check_into_an_argparse_type():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=checked(int, checks.tcp_port))
    assert parser.parse_args(["--port", "8000"]).port == 8000
    for bad in ("0", "eighty"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--port", bad])
