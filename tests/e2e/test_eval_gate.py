"""The accuracy gate: `hybrid-pd eval` through the P/D router against the colocated server.

On the trained embedded model (fp32, CPU) P/D must answer exactly like colocated
(100% identical generations, same accuracy) and above the model's target. A negative
control breaks the hand-off on purpose: a second router, same code, whose transport
gives each decode leg fresh state of the previous question's prompt; the gate must fail.
"""

from __future__ import annotations

import json
import os
import uuid

import httpx
import pytest

from hybrid_pd.bench.router.fake_upstream import serve_in_thread
from hybrid_pd.cli import main as hybrid_pd
from hybrid_pd.router.app import create_app
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.router.upstream import AiohttpTransport

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

QUESTIONS = int(os.environ.get("HYBRID_PD_GATE_QUESTIONS", "30"))
TARGET = 0.8  # the trained model's strict-match target on its own synthetic test split


def _eval(endpoint: str, baseline: str, out, *extra: str, questions: int = QUESTIONS) -> tuple[int, dict]:
    code = hybrid_pd(["eval", "gsm8k", "--dataset", "synthetic", "--endpoint", endpoint, "--baseline", baseline,
                      "--limit", str(questions), "--shots", "0", "--max-tokens", "96", "--concurrency", "4",
                      "--json", str(out), *extra])  # fmt: skip
    return code, json.loads(out.read_text())


def test_pd_answers_exactly_like_colocated_and_above_target(stack, tmp_path):
    colocated = stack.workers("colocated")[0].url
    code, report = _eval(stack.url, colocated, tmp_path / "gate.json", "--tolerance", "0", "--min-agreement", "1")
    endpoint, baseline = report["endpoints"]["endpoint"], report["endpoints"]["baseline"]
    print(f"\ngate: P/D {endpoint['strict_match']} colocated {baseline['strict_match']} agreement {report['comparison']['agreement']}")
    assert code == 0, report["verdict"]
    assert report["comparison"]["agreement"] == 1.0
    assert endpoint["errors"] == baseline["errors"] == 0
    assert endpoint["strict_match"]["value"] >= TARGET


class _OtherRequestsState(httpx.AsyncBaseTransport):
    """Test-only: each decode leg gets fresh state of the *previous* question's prompt.

    The previous prefill request is sent again and its (unconsumed) kv_transfer_params
    replace the current ones, so the decode worker pulls another prompt's h(N-1).
    """

    def __init__(self) -> None:
        self._inner = AiohttpTransport(keepalive_s=RouterSettings().upstream_keepalive_s)  # the router's own
        self._last_prefill: httpx.Request | None = None
        self._other: dict | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or not request.content:
            return await self._inner.handle_async_request(request)
        body = json.loads(request.content)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            previous, self._last_prefill = self._last_prefill, request
            if previous is not None:
                headers = {**previous.headers, "x-request-id": uuid.uuid4().hex}  # a request of its own
                again = await self._inner.handle_async_request(httpx.Request("POST", previous.url, headers=headers, content=previous.content))
                await again.aread()
                self._other = json.loads(again.content)["kv_transfer_params"]
            else:
                self._other = None
        elif params.get("do_remote_prefill") and self._other is not None:
            body["kv_transfer_params"] = self._other
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request("POST", request.url, headers=headers, json=body)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


@pytest.fixture
def broken_router(stack):
    settings = RouterSettings(prefill=[w.url for w in stack.workers("prefill")], decode=[w.url for w in stack.workers("decode")])
    with serve_in_thread(create_app(settings, transport=_OtherRequestsState()), lifespan="on") as url:
        yield url


def test_gate_fails_when_the_hand_off_is_broken(stack, broken_router, tmp_path):
    colocated = stack.workers("colocated")[0].url
    code, report = _eval(broken_router, colocated, tmp_path / "broken.json", "--tolerance", "0", "--min-agreement", "1",
                         "--concurrency", "1", questions=6)  # fmt: skip
    print(f"\nnegative control: agreement {report['comparison']['agreement']}, verdict {report['verdict']}")
    assert code != 0
    assert report["comparison"]["agreement"] < 1.0
