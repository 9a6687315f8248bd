"""deploy/kubernetes cannot be applied here (no cluster): render it as `kubectl apply -k`
would (`kubectl kustomize`), validate every object against the Kubernetes API schema, and
check what a typo would break: selectors against pod labels, Service and probe ports
against container ports, ConfigMap/Secret references and keys, the images set in one place,
the gateway config it assembles (validated by qosgate itself), its upstreams against the
Triton StatefulSet and its stores against the Redis and PostgreSQL Services."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kustomize import render
from qosgate import paths
from qosgate.config import GatewayConfig, parse_config

DEPLOY = paths.project_root() / "deploy" / "kubernetes"
DOCKERFILE = paths.project_root() / "docker" / "Dockerfile"
WORKLOADS = ("Deployment", "StatefulSet")
# Oldest Kubernetes the manifests target.
KUBERNETES_VERSION = "1.30"

Manifest = dict[str, Any]


MANIFESTS = render(DEPLOY)


def of_kind(kind: str) -> list[Manifest]:
    return [m for m in MANIFESTS if m["kind"] == kind]


def named(kind: str, name: str) -> Manifest:
    found = [m for m in of_kind(kind) if m["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name!r}: {len(found)} defined"
    return found[0]


def workloads() -> list[Manifest]:
    return [m for m in MANIFESTS if m["kind"] in WORKLOADS]


def pod_spec(workload: Manifest) -> Manifest:
    return workload["spec"]["template"]["spec"]


def containers(workload: Manifest) -> Iterator[Manifest]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def selected(selector: dict[str, str]) -> list[Manifest]:
    """Workloads whose pods carry every label of `selector`."""
    assert selector, "an empty selector matches every pod"
    return [
        w
        for w in workloads()
        if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def container_ports(workload: Manifest) -> dict[str | int, int]:
    """Port name and number → number, over the workload's containers."""
    ports: dict[str | int, int] = {}
    for container in pod_spec(workload)["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def data_keys(kind: str, name: str) -> set[str]:
    manifest = named(kind, name)
    return set(manifest.get("data", {})) | set(manifest.get("stringData", {}))


def gateway_config() -> GatewayConfig:
    """The file the gateway's init container assembles: ConfigMap part, then Secret part."""
    base = named("ConfigMap", "qosgate-gateway")["data"]["gateway.yaml"]
    tenants = named("Secret", "qosgate-tenants")["stringData"]["tenants.yaml"]
    return parse_config(yaml.safe_load(base + tenants), source="deploy/kubernetes")


def test_every_manifest_is_in_the_kustomization_and_well_formed() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    for manifest in MANIFESTS:
        assert {"apiVersion", "kind", "metadata"} <= manifest.keys()
        assert manifest["metadata"]["name"]
        if manifest["kind"] != "Namespace":
            assert manifest["metadata"]["namespace"] == kustomization["namespace"]


def test_images_are_set_in_the_kustomization_alone() -> None:
    """Each of our images is named without a tag in the manifests and given its name and
    tag by the kustomization's `images`, so a deployer sets them in one place."""
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in yaml.safe_load(
        (DEPLOY / "kustomization.yaml").read_text())["images"]}
    assert set(images) == {"qosgate", "qosgate-triton"}
    for path in DEPLOY.glob("*.yaml"):
        for name in images:
            assert not re.search(rf"image: {name}[:@]", path.read_text()), f"{path.name} tags {name} itself"
    used = {c["image"] for w in workloads() for c in containers(w) if c["image"].split(":")[0] in images}
    assert used == set(images.values())


@pytest.mark.parametrize(
    "manifest", MANIFESTS, ids=lambda m: f"{m['kind']}/{m['metadata']['name']}"
)
def test_manifest_matches_the_kubernetes_api_schema(manifest: Manifest) -> None:
    # Strict: an unknown or misspelt field (`readinesProbe`) fails like a wrong type.
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_workload_selectors_match_their_pods() -> None:
    for workload in workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_services_select_pods_that_have_their_ports() -> None:
    for service in of_kind("Service"):
        name = service["metadata"]["name"]
        targets = selected(service["spec"]["selector"])
        assert len(targets) == 1, f"Service {name} selects {len(targets)} workloads"
        ports = container_ports(targets[0])
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in ports, f"Service {name}: {port}"


def test_probes_use_declared_ports() -> None:
    for workload in workloads():
        ports = container_ports(workload)
        for container in pod_spec(workload)["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                spec = container.get(probe)
                if spec is None:
                    continue
                (kind,) = [k for k in ("grpc", "httpGet", "tcpSocket", "exec") if k in spec]
                if kind != "exec":
                    assert spec[kind]["port"] in ports, f"{container['name']} {probe}"


def test_gateway_probes_are_its_plaintext_health_endpoints() -> None:
    """On the metrics port, plaintext whatever `tls:` says: /readyz (a live Triton) for
    readiness, /healthz (the process serves) for liveness."""
    gateway = named("Deployment", "qosgate-gateway")
    (container,) = pod_spec(gateway)["containers"]
    config = gateway_config()
    listen_port = int(config.listen.rsplit(":", 1)[1])
    metrics_port = int(config.metrics_listen.rsplit(":", 1)[1])
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        check = container[probe]["httpGet"]
        assert (check["path"], container_ports(gateway)[check["port"]]) == (path, metrics_port)
        assert check.get("scheme", "HTTP") == "HTTP"
    assert container_ports(gateway)["grpc"] == listen_port
    assert container_ports(gateway)["metrics"] == metrics_port
    assert container_ports(gateway)["http"] == int(config.openai.listen.rsplit(":", 1)[1])
    assert config.listen.startswith("0.0.0.0:")  # reachable from the Service


def test_configmap_and_secret_references_exist() -> None:
    for workload in workloads():
        spec = pod_spec(workload)
        for volume in spec.get("volumes", []):
            for kind, source, field in (
                ("ConfigMap", volume.get("configMap"), "name"),
                ("Secret", volume.get("secret"), "secretName"),
            ):
                if source is None:
                    continue
                keys = data_keys(kind, source[field])
                for item in source.get("items", []):
                    assert item["key"] in keys, f"{kind} {source[field]} has no {item['key']}"
        for container in containers(workload):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                    if key not in ref:
                        continue
                    if ref[key].get("optional") and not any(
                        m["metadata"]["name"] == ref[key]["name"] for m in of_kind(kind)
                    ):
                        continue  # created by the operator when wanted (e.g. hf-token)
                    assert ref[key]["key"] in data_keys(kind, ref[key]["name"])
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])} | {
                t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])
            }


def test_gateway_config_assembles_and_validates() -> None:
    config = gateway_config()
    assert config.tenants, "no tenants in the Secret"
    assert all(key.sha256 for tenant in config.tenants for key in tenant.api_keys)
    gateway = named("Deployment", "qosgate-gateway")
    init = {c["name"]: c for c in pod_spec(gateway)["initContainers"]}["assemble-config"]
    (main,) = pod_spec(gateway)["containers"]
    assert init["image"] == main["image"]
    script = init["command"][-1]
    assert "/run/qosgate/gateway.yaml" in main["args"]
    # The init script reads the files where the volumes put them and writes the main
    # container's config into the volume both mount.
    for mount, source in (("base-config", "gateway.yaml"), ("tenants", "tenants.yaml")):
        (path,) = [m["mountPath"] for m in init["volumeMounts"] if m["name"] == mount]
        assert f"{path}/{source}" in script
    assert script.index("gateway.yaml") < script.index("tenants.yaml")  # tenants: last key


def test_gateway_shares_quota_state_through_the_redis_service() -> None:
    store = gateway_config().quota_store
    assert store.backend == "redis"
    url = urlsplit(store.redis_url)
    redis_service = named("Service", url.hostname or "")
    assert url.port in {p["port"] for p in redis_service["spec"]["ports"]}
    (container,) = pod_spec(named("Deployment", "qosgate-gateway"))["containers"]
    assert store.password_env in {e["name"] for e in container["env"]}
    redis = named("StatefulSet", "redis")
    (redis_container,) = pod_spec(redis)["containers"]
    assert "$(REDIS_PASSWORD)" in redis_container["args"]
    # The day's token totals outlive the pod: the append-only file is on a claim.
    args = redis_container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    claims = {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    (data,) = [m for m in redis_container["volumeMounts"] if m["name"] in claims]
    assert args[args.index("--dir") + 1] == data["mountPath"]


def test_gateway_shares_batch_jobs_through_the_postgres_service() -> None:
    store = gateway_config().job_store
    assert store.backend == "postgres"
    url = urlsplit(store.postgres_url)
    service = named("Service", url.hostname or "")
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    (postgres,) = selected(service["spec"]["selector"])
    (container,) = pod_spec(postgres)["containers"]
    env = {e["name"]: e for e in container["env"]}
    # The user and database the gateway logs in as are the ones the server creates.
    assert (url.username, url.path.lstrip("/")) == (
        env["POSTGRES_USER"]["value"],
        env["POSTGRES_DB"]["value"],
    )
    (gateway,) = pod_spec(named("Deployment", "qosgate-gateway"))["containers"]
    passwords = {e["name"]: e for e in gateway["env"]}
    assert store.password_env is not None
    assert (
        passwords[store.password_env]["valueFrom"] == env["POSTGRES_PASSWORD"]["valueFrom"]
    )
    # Jobs outlive the pod: the data directory is on a claim, not an emptyDir.
    claims = {t["metadata"]["name"] for t in postgres["spec"]["volumeClaimTemplates"]}
    (data,) = [m for m in container["volumeMounts"] if m["name"] in claims]
    assert env["PGDATA"]["value"].startswith(data["mountPath"] + "/")


def test_gateway_state_is_the_images_state_directory_on_a_volume() -> None:
    """The gateway writes its state directory alone (read-only root filesystem): the
    image's default (XDG_DATA_HOME/qosgate), on the pod's `state` volume."""
    (data_home,) = re.findall(r"^ENV XDG_DATA_HOME=(\S+)$", DOCKERFILE.read_text(), re.M)
    gateway = named("Deployment", "qosgate-gateway")
    (container,) = pod_spec(gateway)["containers"]
    assert gateway_config().state_dir is None  # the image's default
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[f"{data_home}/qosgate"] == "state"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_upstreams_are_the_triton_replicas() -> None:
    triton = named("StatefulSet", "triton")
    headless = named("Service", triton["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert selected(headless["spec"]["selector"]) == [triton]
    grpc_port = container_ports(triton)["grpc"]
    service_ports = {p["port"]: p.get("targetPort") for p in headless["spec"]["ports"]}
    expected = {
        f"triton-{i}.{headless['metadata']['name']}:{grpc_port}"
        for i in range(triton["spec"]["replicas"])
    }
    assert {u.url for u in gateway_config().upstreams} == expected
    assert service_ports[grpc_port] in ("grpc", grpc_port)


def test_triton_is_internal_and_on_gpus() -> None:
    for service in of_kind("Service"):
        if service["metadata"]["name"] != "qosgate":
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    triton = named("StatefulSet", "triton")
    (container,) = pod_spec(triton)["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    gateway_pods = named("Deployment", "qosgate-gateway")["spec"]["template"]["metadata"]["labels"]
    for policy in of_kind("NetworkPolicy"):
        (target,) = selected(policy["spec"]["podSelector"]["matchLabels"])
        ports = container_ports(target)
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                assert peer["podSelector"]["matchLabels"].items() <= gateway_pods.items()
            for port in rule["ports"]:
                assert port["port"] in ports
    protected = {
        selected(p["spec"]["podSelector"]["matchLabels"])[0]["metadata"]["name"]
        for p in of_kind("NetworkPolicy")
    }
    assert protected == {"triton", "redis", "postgres"}


def test_disruption_budgets_select_workloads() -> None:
    budgets = of_kind("PodDisruptionBudget")
    assert budgets
    for budget in budgets:
        (target,) = selected(budget["spec"]["selector"]["matchLabels"])
        assert target["spec"]["replicas"] > budget["spec"]["maxUnavailable"]


def _model_repository_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "model_repository", DEPLOY / "model_repository.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_repository_configmap_matches_its_sources() -> None:
    render = _model_repository_module()
    configmap = named("ConfigMap", render.CONFIGMAP)
    files = render.repository_files()
    stale = (
        "stale: python deploy/kubernetes/model_repository.py > deploy/kubernetes/triton-models.yaml"
    )
    assert configmap["data"] == {render.key_of(path): text for path, text in files.items()}, stale
    assert (DEPLOY / "triton-models.yaml").read_text() == render.render(), stale
    # The StatefulSet's volume puts every file back at its path in the repository.
    (volume,) = [v for v in pod_spec(named("StatefulSet", "triton"))["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == render.CONFIGMAP
    assert {i["key"]: i["path"] for i in volume["configMap"]["items"]} == {
        render.key_of(path): path for path in files
    }


@pytest.mark.parametrize("model", ["llama31_8b_instruct", "minilm"])
def test_gateway_policies_name_served_models(model: str) -> None:
    served = {path.split("/")[0] for path in _model_repository_module().repository_files()}
    assert model in served
    assert model in gateway_config().models
