"""The Kubernetes manifests (deploy/k8s): rendered by kubectl's kustomize, validated, and wired right.

No cluster runs here, so each test checks what can be checked for real: every variant
renders with ``kubectl kustomize`` (Debian's ``kubernetes-client`` package or any kubectl
>= 1.21) and every object validates against the Kubernetes API schemas
(``kubernetes-validate``, strict: an unknown field fails); Services, probes and the
router URL the workers register with point at ports and pods that exist; and every
container's command runs through the CLI (``--dry-run``, as tests/test_deploy.py does
for compose), with its environment as the kubelet builds it, so the manifests and the
code cannot drift apart.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from hybrid_pd.cli import build_parser
from hybrid_pd.common import processes
from hybrid_pd.common.cli_flags import given
from hybrid_pd.worker.settings import WorkerSettings
from tests import deploy_compose as dc
from tests.deploy_support import MASKED_ENV, RESOLVED_BY_THE_WORKER, container_environment, make_demo_services, masked_argv

K8S = dc.ROOT / "deploy" / "k8s"
# `kubectl kustomize deploy/k8s/<variant>`; "." is deploy/k8s itself (the GPU variant).
VARIANTS = [".", "gpu", "gpu-pd", "gpu-rdma", "cpu"]
GPU_VARIANTS = ["gpu", "gpu-pd", "gpu-rdma"]
# The oldest Kubernetes the manifests claim, and the newest the validator knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
# The worker roles and the vLLM kv_role each runs (flex: both, as the routers' planner says).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "flex": "kv_both"}
WORKER_ROLES = tuple(KV_ROLES)
# What a pod's IP looks like where $(POD_IP) is expanded (the kubelet's downward API).
POD_IP = "10.244.1.7"
# Flags a k8s worker has that `make demo`'s do not: it registers itself instead of being listed.
REGISTRATION = {"--router-url", "--router-every-address", "--advertise-url"}
PYPROJECT = tomllib.loads((dc.ROOT / "pyproject.toml").read_text())


def _kubectl_problem() -> str | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "kubectl not found: apt-get install kubernetes-client (or any kubectl >= 1.21) to render deploy/k8s"
    out = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    minor = json.loads(out.stdout)["clientVersion"]["minor"] if out.returncode == 0 else ""
    if not minor[:2].isdigit() or int(minor[:2]) < 21:
        return f"kubectl 1.{minor or '?'} embeds kustomize v2, which cannot render deploy/k8s: use kubectl >= 1.21"
    return None


pytestmark = pytest.mark.skipif(bool(_kubectl_problem()), reason=_kubectl_problem() or "")


@functools.cache
def render(variant: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / variant)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not out.stderr.strip(), f"kustomize warns: {out.stderr}"
    return tuple(yaml.safe_load_all(out.stdout))


def objects(variant: str, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in render(variant) if o["kind"] == kind}


@dataclass(frozen=True)
class Container:
    """One container of a Deployment's pod, with what the kubelet would hand it."""

    deployment: str
    pod: dict[str, Any]
    spec: dict[str, Any]
    variant: str

    @property
    def argv(self) -> list[str]:
        return [*self.spec.get("command", []), *self.spec.get("args", [])]

    @property
    def role(self) -> str | None:
        argv = self.argv
        return argv[1] if argv[:1] == ["hybrid-pd"] else None

    def flags(self) -> dict[str, str | None]:
        return dict(dc.parse_flags(self.argv[2:]))

    def port(self, ref: str | int) -> int:
        """The container port a probe or a Service names (by name or number); KeyError if it declares none."""
        for port in self.spec.get("ports", []):
            if ref in (port.get("name"), port["containerPort"]):
                return port["containerPort"]
        raise KeyError(f"{self.deployment}/{self.spec['name']} declares no port {ref!r}")

    def env(self, overrides: dict[str, str] | None = None) -> dict[str, str]:
        """The container's environment as the kubelet builds it (Secrets that are not optional get a stand-in)."""
        config = {n: o.get("data", {}) for n, o in objects(self.variant, "ConfigMap").items()}
        env: dict[str, str] = {}
        for source in self.spec.get("envFrom", []):
            env |= config[source["configMapRef"]["name"]]
        env |= overrides or {}
        for var in self.spec.get("env", []):
            ref = var.get("valueFrom", {})
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "fieldRef" in ref:
                assert ref["fieldRef"]["fieldPath"] == "status.podIP", var
                env[var["name"]] = POD_IP
            elif "configMapKeyRef" in ref:
                env[var["name"]] = config[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
            elif "secretKeyRef" in ref and not ref["secretKeyRef"].get("optional"):
                env[var["name"]] = f"secret-{ref['secretKeyRef']['name']}-{ref['secretKeyRef']['key']}"
        return env

    def expanded_argv(self, env: dict[str, str]) -> list[str]:
        """``$(VAR)`` in the command and arguments expanded from the environment, as the kubelet does."""

        def expand(text: str) -> str:
            return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)

        return [expand(a) for a in self.argv]


def containers(variant: str) -> list[Container]:
    found = []
    for name, deployment in objects(variant, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        found += [Container(name, pod, c, variant) for c in pod["containers"]]
    return found


def workers(variant: str) -> list[Container]:
    return [c for c in containers(variant) if c.role in WORKER_ROLES]


def router(variant: str) -> Container:
    (found,) = [c for c in containers(variant) if c.role == "router"]
    return found


def pods_selected(variant: str, selector: dict[str, str]) -> list[str]:
    return [
        name
        for name, d in objects(variant, "Deployment").items()
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]


def run_in_container(dry_run, container: Container, overrides: dict[str, str] | None = None) -> dict[str, Any]:  # noqa: F811
    env = container.env(overrides)
    argv = container.expanded_argv(env)
    assert argv[0] == "hybrid-pd"
    return dry_run(argv[1:], env)


# ---------------------------------------------------------------- rendering and the schemas


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_renders_and_every_object_validates_against_the_kubernetes_schemas(variant: str):
    rendered = render(variant)
    assert {o["kind"] for o in rendered} >= {"Deployment", "Service", "ConfigMap"}
    for obj in rendered:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_a_broken_object():
    broken = json.loads(json.dumps(objects("gpu-pd", "Deployment")["decode"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/health", "port": 8200}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_deploy_k8s_itself_is_the_gpu_variant():
    assert render(".") == render("gpu")


def _replicas(c: Container) -> int:
    return objects(c.variant, "Deployment")[c.deployment]["spec"]["replicas"]


def test_variants_have_a_router_and_workers_that_can_both_prefill_and_decode():
    """Fixed roles: a prefill and a decode Deployment; flexible workers: two pods or more, for the planner to split."""
    expected = {".": ["flex"], "gpu": ["flex"], "gpu-rdma": ["flex"], "gpu-pd": ["decode", "prefill"], "cpu": ["decode", "prefill"]}
    assert set(expected) == set(VARIANTS)
    for variant, roles in expected.items():
        assert sorted(c.role for c in workers(variant)) == roles, variant
        assert all(_replicas(c) >= (2 if c.role == "flex" else 1) for c in workers(variant)), variant
        assert router(variant).deployment == "router"


def test_flexible_workers_run_as_the_fixed_roles_do():
    """gpu/flex.yaml is gpu-pd/prefill.yaml but for the role (names, labels, command) and the replicas: the same
    arguments, ports, probes, resources and pod."""
    (flex,) = workers("gpu")
    (prefill,) = [c for c in workers("gpu-pd") if c.role == "prefill"]

    def masked(c: Container) -> tuple[dict[str, Any], dict[str, Any]]:
        return {k: v for k, v in c.spec.items() if k not in ("name", "command")}, {k: v for k, v in c.pod.items() if k != "containers"}

    assert masked(flex) == masked(prefill)
    assert (flex.spec["name"], flex.spec["command"]) == ("flex", ["hybrid-pd", "flex"])


# ---------------------------------------------------------------- ports, Services, probes


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_select_the_router_and_target_a_port_it_declares(variant: str):
    for name, service in objects(variant, "Service").items():
        assert pods_selected(variant, service["spec"]["selector"]) == ["router"], name
        for port in service["spec"]["ports"]:
            assert router(variant).port(port["targetPort"]) == int(router(variant).flags()["--port"]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_ask_health_on_the_port_the_server_listens_on(variant: str):
    for c in containers(variant):
        listens = int(c.flags()["--port"])
        assert c.spec["readinessProbe"]["httpGet"]["path"] == "/health"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.spec.get(kind)
            if probe is not None:
                port = (probe.get("httpGet") or probe["tcpSocket"])["port"]
                assert c.port(port) == listens, f"{c.deployment}/{c.spec['name']} {kind}"
        if c.role in WORKER_ROLES:
            assert c.spec["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c.spec["startupProbe"]["failureThreshold"] * c.spec["startupProbe"]["periodSeconds"] >= 600


def _window(probe: dict[str, Any]) -> int:
    """Seconds of failed checks after which the kubelet acts on a probe."""
    return probe["periodSeconds"] * probe.get("failureThreshold", 3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_worker_probes_act_only_after_the_workers_own_windows(variant: str):
    """The worker ends a vLLM that does not start in --ready-timeout-s, or that stops serving for --serve-stall-s,
    itself, and exits 3 with a line saying why (hybrid_pd/worker/supervise.py); the probes are the backstop for a
    worker service that hangs: they act just after those windows, never before."""
    for c in workers(variant):
        with container_environment(c.env()):
            settings = WorkerSettings(**given(build_parser().parse_args(c.expanded_argv(c.env())[1:]), WorkerSettings))
        startup, liveness = c.spec["startupProbe"], c.spec["livenessProbe"]
        assert _window(startup) >= settings.ready_timeout_s + startup["periodSeconds"], c.deployment
        assert settings.serve_stall_s < _window(liveness) <= settings.serve_stall_s + 2 * liveness["periodSeconds"], c.deployment


@pytest.mark.parametrize("variant", VARIANTS)
def test_port_names_are_unique_in_a_pod_and_valid(variant: str):
    for name, deployment in objects(variant, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        names = [p["name"] for c in pod["containers"] for p in c.get("ports", [])]
        assert len(names) == len(set(names)), f"{name}: the API server refuses duplicate port names {names}"
        for port_name in names:  # IANA_SVC_NAME, which the schemas do not check
            assert len(port_name) <= 15 and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", port_name), port_name
            assert re.search("[a-z]", port_name), port_name


# ---------------------------------------------------------------- registration and the side channel


@pytest.mark.parametrize("variant", VARIANTS)
def test_workers_register_through_a_service_that_reaches_the_router_before_it_is_ready(variant: str):
    services = objects(variant, "Service")
    routed = router(variant)
    for c in workers(variant):
        url = urlsplit(c.flags()["--router-url"])
        assert url.scheme == "http" and url.path in ("", "/")
        service = services[url.hostname]  # a Service of the same namespace: its name resolves
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
        assert routed.port(port["targetPort"]) == int(routed.flags()["--port"])
        assert pods_selected(variant, service["spec"]["selector"]) == ["router"]
        # The router turns ready once a decode worker registered: registration cannot wait for that.
        assert service["spec"]["publishNotReadyAddresses"] is True
        # Headless: the name resolves to every router pod, reached at the URL's port itself (no mapping).
        assert service["spec"]["clusterIP"] == "None" and "--router-every-address" in c.flags()
        assert url.port == int(routed.flags()["--port"])
    ready = [n for n, s in services.items() if not s["spec"].get("publishNotReadyAddresses")]
    assert ready == ["router"], "clients reach the router only once it can serve"


@pytest.mark.parametrize("variant", VARIANTS)
def test_workers_and_router_share_the_admin_token_secret(variant: str):
    def token_ref(c: Container, name: str) -> dict[str, Any]:
        (var,) = [v for v in c.spec["env"] if v["name"] == name]
        return var["valueFrom"]["secretKeyRef"]

    expected = token_ref(router(variant), "HYBRID_PD_ROUTER_ADMIN_TOKEN")
    assert not expected.get("optional"), "without the token the admin API is off and no worker can register"
    for c in workers(variant):
        assert token_ref(c, "HYBRID_PD_WORKER_ADMIN_TOKEN") == expected
    for c in containers(variant):
        literal = [v["name"] for v in c.spec.get("env", []) if "value" in v and re.search("TOKEN|KEY", v["name"])]
        assert not literal, f"secrets come from Secrets: {literal}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_workers_advertise_their_pod_ip(variant: str):
    for c in workers(variant):
        flags = c.flags()
        assert flags["--advertise-url"] == f"http://$(POD_IP):{flags['--port']}"
        assert c.port(int(flags["--port"])) == int(flags["--port"])
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c.spec["env"]
        if variant == "cpu":  # both roles in one pod: the side channel stays inside it
            assert "--side-channel-host" not in flags
        else:
            assert flags["--side-channel-host"] == "$(POD_IP)"


# ---------------------------------------------------------------- the routers' planner


def _planned(variant: str) -> bool:
    return any(c.role == "flex" for c in workers(variant))


@pytest.mark.parametrize("variant", VARIANTS)
def test_routers_in_front_of_flexible_workers_agree_through_router_admin(dry_run, variant: str):  # noqa: F811
    """Each router asks every router pod (a headless Service: one address each) and the one up longest decides."""
    routed = router(variant)
    peers = run_in_container(dry_run, routed)["planner_peers"]
    if not _planned(variant):
        assert peers == [], "no flexible worker: nothing to plan"
        return
    assert objects(variant, "Deployment")["router"]["spec"]["replicas"] >= 2
    (url,) = map(urlsplit, peers)
    service = objects(variant, "Service")[url.hostname]
    assert service["spec"]["clusterIP"] == "None" and pods_selected(variant, service["spec"]["selector"]) == ["router"]
    # Headless: each address is a router pod, asked at the URL's port itself, where the router listens.
    assert url.port == int(routed.flags()["--port"]) and url.port in [p["port"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_planner_profile_and_targets_come_from_a_config_map_empty_by_default(dry_run, variant: str):  # noqa: F811
    """Empty: the flexible workers serve whole requests (no profile, no bound); the ConfigMap's values reach the router."""
    routed = router(variant)
    if not _planned(variant):
        assert "envFrom" not in routed.spec
        return
    (source,) = routed.spec["envFrom"]
    data = objects(variant, "ConfigMap")[source["configMapRef"]["name"]]["data"]
    keys = ("HYBRID_PD_ROUTER_PLANNER_PROFILE", "HYBRID_PD_ROUTER_SLO_TTFT_MS", "HYBRID_PD_ROUTER_SLO_TPOT_MS")
    assert data == dict.fromkeys(keys, "")
    out = run_in_container(dry_run, routed)
    assert (out["planner_profile"], out["slo_ttft_ms"], out["slo_tpot_ms"]) == (None, None, None)
    out = run_in_container(dry_run, routed, dict(zip(keys, ("nemotron-h-8b-h100", "500", "20"))))
    assert (out["planner_profile"], out["slo_ttft_ms"], out["slo_tpot_ms"]) == ("nemotron-h-8b-h100", 500.0, 20.0)


# ---------------------------------------------------------------- every command runs through the CLI


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_command_runs_through_the_cli(dry_run, variant: str):  # noqa: F811
    for c in workers(variant):
        out = run_in_container(dry_run, c)
        argv, env = out["argv"], out["env"]
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_role"] == KV_ROLES[c.role]
        http = [p for p in c.spec["ports"] if p["name"].endswith("http")]
        nixl = [p for p in c.spec["ports"] if p["name"].endswith("nixl")]
        assert argv[argv.index("--port") + 1] == str(http[0]["containerPort"])
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(nixl[0]["containerPort"])
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == ("127.0.0.1" if variant == "cpu" else POD_IP)
        assert env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    routed = run_in_container(dry_run, router(variant))
    assert routed["port"] == router(variant).port("http") and routed["host"] == "0.0.0.0"
    assert routed["admin_token"] == "***" and routed["prefill"] == routed["decode"] == routed["flex"] == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_side_channel_ports_are_distinct_where_workers_can_share_an_address(dry_run, variant: str):  # noqa: F811
    """One pod (cpu) or one node's network (gpu-rdma; a Deployment's pods never share a node there: host ports): the
    roles must not collide."""
    ports = [run_in_container(dry_run, c)["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] for c in workers(variant)]
    http = [c.flags()["--port"] for c in workers(variant)]
    assert len(set(ports)) == len(set(http)) == len(workers(variant))


# ---------------------------------------------------------------- GPUs, RDMA, images, lifecycle


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_gpu_workers_reserve_one_gpu_per_tensor_parallel_rank(variant: str):
    for c in workers(variant):
        flags = c.flags()
        assert flags["--device"] == "cuda"
        assert c.spec["resources"]["limits"]["nvidia.com/gpu"] == flags["--tensor-parallel-size"]
        assert c.spec["image"].startswith("hybrid-pd-worker-gpu:")
        assert any(t.get("key") == "nvidia.com/gpu" for t in c.pod["tolerations"])
        shm = [v for v in c.pod["volumes"] if v["name"] == "shm"]
        assert shm[0]["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in c.spec["volumeMounts"]


def test_rdma_variant_uses_the_node_network_rdma_devices_and_reaches_vllm(dry_run):  # noqa: F811
    for c in workers("gpu-rdma"):
        assert c.pod["hostNetwork"] is True
        assert c.pod["dnsPolicy"] == "ClusterFirstWithHostNet", "router-admin must still resolve"
        assert "IPC_LOCK" in c.spec["securityContext"]["capabilities"]["add"]
        assert any(r.startswith("rdma/") for r in c.spec["resources"]["limits"])
        # The ConfigMap's UCX setting, once set, is what vLLM's UCX gets.
        assert c.env()["HYBRID_PD_WORKER_UCX_NET_DEVICES"] == ""
        out = run_in_container(dry_run, c, {"HYBRID_PD_WORKER_UCX_NET_DEVICES": "mlx5_0:1"})
        assert out["env"]["UCX_NET_DEVICES"] == "mlx5_0:1"
    for c in workers("gpu") + workers("gpu-pd"):
        assert not c.pod.get("hostNetwork")


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_the_repositorys_and_have_what_the_pods_run(variant: str):
    for name, deployment in objects(variant, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            image, _, tag = c["image"].partition(":")
            assert tag == PYPROJECT["project"]["version"], c["image"]
            dockerfile = dc.Dockerfile.read(K8S.parent / f"{image.removeprefix('hybrid-pd-')}.Dockerfile")
            assert c["command"][0] in dockerfile.programs() | {"python"}, c["command"]
            if c["command"][1:] == ["deploy/fetch_model.py"]:
                assert dockerfile.copied("deploy/fetch_model.py")
            uid = re.search(r"ARG APP_UID=(\d+)", dockerfile.path.read_text()).group(1)
            assert pod["securityContext"]["runAsUser"] == int(uid) and pod["securityContext"]["runAsNonRoot"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_workers_drain_within_their_grace_period_and_vllm_orphans_are_reaped(variant: str):
    drain = WorkerSettings.model_fields["drain_timeout_s"].default
    for c in workers(variant):
        assert c.pod["terminationGracePeriodSeconds"] >= drain + 15 + 10, "drain, then vLLM's 15 s stop, with margin"
        assert c.pod["shareProcessNamespace"] is True, "the pause container reaps vLLM's orphans (compose: init)"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_router_runs_several_replicas_and_workers_register_with_each(variant: str):
    """Each replica keeps its own registry: workers fan out to every address of router-admin (deploy/README.md)."""
    assert objects(variant, "Deployment")["router"]["spec"]["replicas"] >= 2
    for c in workers(variant):
        settings = WorkerSettings(**given(build_parser().parse_args(c.expanded_argv(c.env())[1:]), WorkerSettings))
        assert settings.router_every_address is True and settings.router_urls == ("http://router-admin:8000",)


# ---------------------------------------------------------------- the cpu variant is `make demo`


def test_cpu_workers_share_one_pod_as_loopback_transfers_need(dry_run):  # noqa: F811
    (pod,) = {c.deployment for c in workers("cpu")}
    assert objects("cpu", "Deployment")[pod]["spec"]["replicas"] == 1
    for c in workers("cpu"):
        assert c.flags()["--device"] == "cpu" and c.spec["image"].startswith("hybrid-pd-worker-cpu:")
        assert "nvidia.com/gpu" not in json.dumps(c.spec["resources"])
        assert run_in_container(dry_run, c)["env"]["UCX_NET_DEVICES"] == "lo"


def test_cpu_variant_runs_the_command_lines_of_make_demo(dry_run, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    monkeypatch.setattr(processes, "listen_problem", lambda host, port: None)  # planned, not started: 8000 may be taken
    demo = make_demo_services(monkeypatch)
    ours = {c.role: c for c in workers("cpu")}
    assert set(ours) == set(demo) - {"router"}
    for role, c in ours.items():
        flags = sorted(f for f, _ in dc.parse_flags(c.argv[2:]) if f not in REGISTRATION)
        assert flags == sorted(f for f, _ in dc.parse_flags(demo[role][1:]) if f not in RESOLVED_BY_THE_WORKER)
        k8s, local = run_in_container(dry_run, c), dry_run(demo[role])
        assert masked_argv(k8s["argv"]) == masked_argv(local["argv"])
        assert {k: v for k, v in k8s["env"].items() if k not in MASKED_ENV} == {
            k: v for k, v in local["env"].items() if k not in MASKED_ENV
        }
    # The router: the same settings but for where it listens, its workers (registered, not listed) and the token.
    k8s, local = run_in_container(dry_run, router("cpu")), dry_run(demo["router"])
    differ = {"host", "port", "prefill", "decode", "admin_token"}
    assert {k: v for k, v in k8s.items() if k not in differ} == {k: v for k, v in local.items() if k not in differ}
