"""A worker joins every router replica: the URL list, the DNS fan-out, and real routers coming and going.

The routers here are the router app itself (:func:`hybrid_pd.router.app.create_app`) on real
sockets; replicas of one URL share its port on different loopback addresses (127.0.0.1,
127.0.0.2), which the injected resolver hands out as a headless Service's DNS would.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import uvicorn
from pydantic import ValidationError

from hybrid_pd.cli import build_parser
from hybrid_pd.common.cli_flags import given
from hybrid_pd.common.processes import free_port
from hybrid_pd.connector.compat import WorkerIdentity
from hybrid_pd.router.app import create_app
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.worker.registration import RouterLink, fan_out, replica_urls
from hybrid_pd.worker.settings import WorkerSettings

TOKEN = "admin-secret"
WORKER = "http://127.0.0.1:9"  # where the worker says it is: nobody answers, registration does not need it to
ADDRESSES = ("127.0.0.1", "127.0.0.2")


@contextmanager
def router_at(host: str, port: int) -> Iterator[str]:
    """A real router (admin API on) listening on ``host:port``; yields its URL."""
    app = create_app(RouterSettings(admin_token=TOKEN))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, lifespan="on", log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), f"router on {host}:{port} did not start"
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def workers_at(url: str) -> list[dict]:
    """``GET /admin/workers`` of the router at ``url``."""
    response = httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    response.raise_for_status()
    return response.json()["workers"]


def link(router_urls: tuple[str, ...], **options) -> RouterLink:
    return RouterLink(router_urls, WORKER, WorkerIdentity(role="decode", model="m"), TOKEN, interval_s=3600, **options)


class Dns:
    """A resolver the test edits: host -> addresses, or an error."""

    def __init__(self, **records: list[str] | OSError) -> None:
        self.records = records

    def __call__(self, host: str) -> list[str]:
        answer = self.records.get(host, OSError(f"{host}: no such host"))
        if isinstance(answer, OSError):
            raise answer
        return answer


@pytest.fixture
def replicas() -> Iterator[tuple[int, dict[str, str]]]:
    """Two routers on one port, at 127.0.0.1 and 127.0.0.2: (port, address -> URL)."""
    port = free_port()
    with ExitStack() as stack:
        yield port, {address: stack.enter_context(router_at(address, port)) for address in ADDRESSES}


# ---------------------------------------------------------------- settings


def test_router_url_takes_a_comma_separated_list_of_replicas():
    settings = WorkerSettings(router_url="http://a:8000, http://b:8000/,http://a:8000")
    assert settings.router_urls == ("http://a:8000", "http://b:8000")
    assert WorkerSettings(router_url="http://a:8000").router_urls == ("http://a:8000",)
    assert WorkerSettings().router_urls == ()
    for bad in ("http://a:8000,b:8000", "http://a:8000,", "ftp://a"):
        with pytest.raises(ValidationError, match="is not an http"):
            WorkerSettings(router_url=bad)


def test_router_every_address_is_a_flag_and_an_environment_variable(monkeypatch: pytest.MonkeyPatch):
    def parsed(*argv: str) -> WorkerSettings:
        return WorkerSettings(**given(build_parser().parse_args(["decode", *argv]), WorkerSettings))

    assert parsed().router_every_address is False
    assert parsed("--router-url", "http://router-admin:8000", "--router-every-address").router_every_address is True
    monkeypatch.setenv("HYBRID_PD_WORKER_ROUTER_EVERY_ADDRESS", "true")
    assert parsed().router_every_address is True
    assert parsed("--no-router-every-address").router_every_address is False


# ---------------------------------------------------------------- the fan-out, without DNS


def test_fan_out_gives_one_replica_per_address_same_scheme_and_port_each_once():
    dns = Dns(routers=["10.0.0.1", "10.0.0.2", "10.0.0.1"], other=["10.0.0.2"], v6=["fd00::7"])
    found = fan_out(("http://routers:8000", "https://other:8000", "http://v6:80", "http://routers:8000"), dns, {})
    assert found == {
        "http://routers:8000": ("http://10.0.0.1:8000", "http://10.0.0.2:8000"),
        "https://other:8000": ("https://10.0.0.2:8000",),
        "http://v6:80": ("http://[fd00::7]:80",),
    }
    assert fan_out(("http://routers",), dns, {}) == {"http://routers": ("http://10.0.0.1", "http://10.0.0.2")}
    assert replica_urls({"a": ("http://x:1", "http://y:1"), "b": ("http://y:1", "http://z:1")}) == ("http://x:1", "http://y:1", "http://z:1")


def test_a_host_that_fails_to_resolve_keeps_its_last_replicas_or_has_none_yet(caplog: pytest.LogCaptureFixture):
    dns = Dns(routers=OSError("temporary failure in name resolution"))
    known = {"http://routers:8000": ("http://10.0.0.1:8000",)}
    with caplog.at_level(logging.WARNING, "hybrid_pd.worker.registration"):
        assert fan_out(("http://routers:8000",), dns, known) == known
        assert fan_out(("http://routers:8000",), dns, {}) == {"http://routers:8000": ()}
    assert "router=http://routers:8000" in caplog.text and "kept=1" in caplog.text and "kept=0" in caplog.text


# ---------------------------------------------------------------- real routers


def test_every_listed_replica_gets_the_registration_heartbeats_drain_and_deregistration(replicas):
    _port, urls = replicas
    worker = link(tuple(urls.values()))
    worker.start()
    try:
        for url in urls.values():
            (seen,) = workers_at(url)
            assert (seen["url"], seen["role"], seen["id"]) == (WORKER, "decode", worker.replicas[url].worker_id)
        worker.beat()  # heartbeats: still one registration each
        assert [len(workers_at(url)) for url in urls.values()] == [1, 1]
        worker.drain()
        assert [w["state"] for url in urls.values() for w in workers_at(url)] == ["draining", "draining"]
        worker.deregister()
        assert [workers_at(url) for url in urls.values()] == [[], []]
    finally:
        worker.drain()


def test_replicas_that_appear_learn_the_worker_at_the_next_heartbeat_and_gone_ones_are_dropped(replicas, caplog):
    port, urls = replicas
    dns = Dns(routers=["127.0.0.1"])
    worker = link((f"http://routers:{port}",), every_address=True, resolve=dns)
    worker.start()
    try:
        assert (len(workers_at(urls["127.0.0.1"])), len(workers_at(urls["127.0.0.2"]))) == (1, 0)
        dns.records["routers"] = ["127.0.0.2", "127.0.0.1", "127.0.0.2"]  # a second router pod, listed twice
        worker.beat()
        assert [len(workers_at(url)) for url in urls.values()] == [1, 1]
        assert set(worker.replicas) == set(urls.values())
        dns.records["routers"] = ["127.0.0.2"]  # the first pod went away
        worker.beat()
        assert list(worker.replicas) == [urls["127.0.0.2"]]
        dns.records["routers"] = OSError("no answer")  # DNS hiccup: keep talking to the last replicas
        with caplog.at_level(logging.WARNING, "hybrid_pd.worker.registration"):
            worker.beat()
        assert list(worker.replicas) == [urls["127.0.0.2"]] and f"router=http://routers:{port}" in caplog.text
    finally:
        worker.drain()


def test_a_replica_that_is_down_never_holds_up_the_others_and_is_retried(caplog: pytest.LogCaptureFixture):
    port = free_port()
    down = f"http://127.0.0.2:{port}"
    with router_at("127.0.0.1", port) as up:
        worker = link((down, up))
        with caplog.at_level(logging.WARNING, "hybrid_pd.worker.registration"):
            worker.start()
        try:
            assert len(workers_at(up)) == 1 and worker.replicas[down].worker_id is None
            assert f"router={down}" in caplog.text and f"router={up}" not in caplog.text
            with router_at("127.0.0.2", port):  # it comes up: the next heartbeat registers there too
                worker.beat()
                assert len(workers_at(down)) == 1 and len(workers_at(up)) == 1
        finally:
            worker.drain()


def test_a_replica_that_forgot_the_worker_gets_a_fresh_registration_the_others_keep_theirs(replicas):
    _port, urls = replicas
    first, second = urls.values()
    worker = link((first, second))
    worker.start()
    try:
        kept = worker.replicas[second].worker_id
        forgotten = worker.replicas[first].worker_id
        httpx.delete(f"{first}/admin/workers/{forgotten}", headers={"Authorization": f"Bearer {TOKEN}"}).raise_for_status()
        assert workers_at(first) == []
        worker.beat()  # 404 from the first: register again there; a heartbeat to the second
        (again,) = workers_at(first)
        assert again["id"] == worker.replicas[first].worker_id != forgotten
        assert [w["id"] for w in workers_at(second)] == [kept] == [worker.replicas[second].worker_id]
    finally:
        worker.drain()
