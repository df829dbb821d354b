"""deploy/rayservice.yaml against KubeRay's RayService CRD (deploy/crd/, KubeRay v1.7.0) and against this code:
what it deploys is what `build_app` and the CLI accept, and nothing in it waits on something that waits on it.
No Kubernetes here: what KubeRay adds to the pods (labels, probes) is restated from its v1.7.0 source."""
from __future__ import annotations

import copy
import functools
import shlex
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.__main__ import cluster_parser
from gateway.__main__ import build_parser
from gateway.response_store import RESPONSES_DB_ENV
from gateway.salt_secret import SALT_SECRET_ENV

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IMAGE = f"prefixgate-cluster:{PYPROJECT['project']['version']}"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 1 MB: libyaml reads it in 0.2 s, not 1 s
SERVE_PROXY_PORT, RAY_METRICS_PORT = 8000, 8080  # Serve's proxy; the metrics-export-port KubeRay gives `ray start`
# labels KubeRay sets on every Ray pod (common/pod.go: labelPod, BuildPod); its services select on them
KUBERAY_LABELS = ("ray.io/node-type", "ray.io/group", "ray.io/cluster", "ray.io/is-ray-node", "ray.io/identifier",
                  "ray.io/serve", "app.kubernetes.io/name", "app.kubernetes.io/created-by")
DEPRECATED_FIELDS = ("serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold")  # KubeRay ignores them


@functools.cache
def _documents() -> dict[str, dict]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "rayservice.yaml").read_text())
    return {doc["kind"]: doc for doc in docs}


def _rayservice() -> dict:
    return copy.deepcopy(_documents()["RayService"])


def _serve_config():
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.model_validate(yaml.safe_load(_rayservice()["spec"]["serveConfigV2"]))


def _groups() -> dict[str, dict]:
    return {g["groupName"]: g for g in _rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _gateway_argv() -> list[str]:
    """The gateway's command line: the script's second line, after the first waits for the pod's Ray node."""
    (gateway,) = [c for c in _groups()["gateway"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    assert gateway["command"] == ["bash", "-c"]
    wait, command = gateway["args"][0].replace("\\\n", " ").strip().splitlines()
    assert "/tmp/ray/ray_current_cluster" in wait  # written by `ray start`, read by `--address auto`
    exec_, *argv = shlex.split(command)
    assert exec_ == "exec" and argv[:3] == ["python", "-m", "cluster"]
    return argv[3:]


@functools.cache
def _crd_validator() -> jsonschema.Draft4Validator:
    crd = yaml.load((ROOT / "deploy" / "crd" / "ray.io_rayservices.yaml").read_text(), Loader=LOADER)
    version = _rayservice()["apiVersion"].split("/")[1]
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _json_schema(entry["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def _json_schema(node: dict) -> dict:
    """A CRD's OpenAPI v3 schema as JSON Schema. `nullable` admits null; an object with listed properties refuses
    any other, where Kubernetes would drop it silently (pruning) and hide a misspelled or retired field. The
    x-kubernetes-* keys and `format` are not JSON Schema and are ignored (int-or-string comes with an anyOf)."""
    out = dict(node)
    if "properties" in node:
        out["properties"] = {name: _json_schema(sub) for name, sub in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = _json_schema(node["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [_json_schema(sub) for sub in node[key]]
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    return out


def _quantity(text: str) -> float:
    """A Kubernetes quantity (the suffixes this manifest uses) as a number."""
    for suffix, scale in (("Gi", 2**30), ("Mi", 2**20)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def _pod_labels(template: dict, node_type: str, group: str) -> dict[str, str]:
    """The labels of a pod of this template: its own, and the three KubeRay sets whatever the template says
    (the rest of KubeRay's are left out: the test below keeps templates off them)."""
    own = template.get("metadata", {}).get("labels", {})
    return {**own, "ray.io/node-type": node_type, "ray.io/group": group, "ray.io/cluster": "prefixgate-abcde"}


def test_the_rayservice_is_valid_under_kuberays_crd_and_uses_no_ignored_field():
    service = _rayservice()
    assert service["apiVersion"] == "ray.io/v1"
    _crd_validator().validate(service)
    assert not set(DEPRECATED_FIELDS) & set(service["spec"])
    # without it KubeRay waits for ever; with it, the first start (image pull, model load) must fit
    assert service["metadata"]["annotations"]["ray.io/initializing-timeout"] == "1h"


@pytest.mark.parametrize(("path", "value", "error_path"), [
    (("workerGroupSpecs", 0, "replicas"), "four", ["workerGroupSpecs", 0, "replicas"]),
    (("workerGroupSpecs", 0, "rayStartParams", "num-cpus"), 4, ["workerGroupSpecs", 0, "rayStartParams", "num-cpus"]),
    (("headGroupSpec", "rayStartParam"), {"num-cpus": "0"}, ["headGroupSpec"]),  # Kubernetes would drop it
    (("workerGroupSpecs", 1, "template", "spec", "containers", 1, "readinesProbe"), {},
     ["workerGroupSpecs", 1, "template", "spec", "containers", 1]),
    (("workerGroupSpecs", 0, "minReplicas"), None, ["workerGroupSpecs", 0]),  # None: removed (it is required)
], ids=["replicas-not-an-integer", "ray-start-param-not-a-string", "misspelled-field", "misspelled-probe",
        "required-field-missing"])
def test_the_crd_schema_rejects_a_broken_manifest(path, value, error_path):
    service = _rayservice()
    parent = service["spec"]["rayClusterConfig"]
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError) as caught:
        _crd_validator().validate(service)
    assert list(caught.value.absolute_path) == ["spec", "rayClusterConfig", *error_path]


def test_the_serve_app_is_what_build_app_builds_one_replica_per_engine_pod():
    from ray.serve.config import ProxyLocation

    from cluster.replica import build_app

    config = _serve_config()  # as Ray's dashboard reads what KubeRay submits
    assert config.proxy_location == ProxyLocation.EveryNode  # KubeRay's worker readiness asks the proxy
    assert config.http_options.port == SERVE_PROXY_PORT
    (app,) = config.applications
    # the proxy's /-/healthz fails until an app has a route (EngineReplica.__call__ answers it)
    assert (app.name, app.import_path, app.route_prefix) == ("prefixgate", "cluster.replica:build_app", "/engine")
    deployment = build_app(app.args)._bound_deployment  # no Ray started: the bound app only
    engines = _groups()["engines"]
    assert deployment.num_replicas == engines["replicas"] == 4
    assert deployment.ray_actor_options == {"num_cpus": 4.0, "memory": 6 * 2**30}
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class == "cluster.router:PrefixAffinityRouter"
    assert router.request_router_kwargs == {"index": "prefixgate", "mean_load_factor": 1.25}
    (pin,) = PYPROJECT["project"]["optional-dependencies"]["cluster"]
    ray_version = _rayservice()["spec"]["rayClusterConfig"]["rayVersion"]
    assert pin == f"ray[serve]=={ray_version}"
    assert f"FROM rayproject/ray:{ray_version}-" in (ROOT / "deploy" / "Dockerfile").read_text()


def test_every_worker_group_has_a_fixed_size_and_room_for_exactly_its_replicas():
    from cluster.replica import build_app

    deployment = build_app(_serve_config().applications[0].args)._bound_deployment
    cpus, memory = deployment.ray_actor_options["num_cpus"], deployment.ray_actor_options["memory"]
    for name, group in _groups().items():
        # KubeRay wants both bounds without its autoscaler, and clamps replicas into them
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"], name
        ray_cpus = float(group["rayStartParams"]["num-cpus"])
        ray_container = group["template"]["spec"]["containers"][0]
        limits, requests = ray_container["resources"]["limits"], ray_container["resources"]["requests"]
        assert limits == requests, name  # Guaranteed QoS: what Ray is told is what the pod gets
        if name == "engines":
            assert ray_cpus == _quantity(limits["cpu"]) == cpus  # one replica's CPUs: exactly one fits
            assert memory <= _quantity(limits["memory"]) < 2 * memory  # KubeRay gives Ray the limit as memory
        else:
            assert ray_cpus == 0, name  # no replica lands here
    assert _rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_nothing_in_the_head_pod_waits_for_the_serve_app():
    """KubeRay submits serveConfigV2 once the head pod is Ready: the head pod holds Ray's container alone, with
    KubeRay's own probes (GCS and raylet), so it becomes Ready before the app exists."""
    head = _rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    (ray_head,) = head["spec"]["containers"]
    assert "readinessProbe" not in ray_head and "livenessProbe" not in ray_head and "command" not in ray_head
    ports = {p["name"]: p["containerPort"] for p in ray_head["ports"]}
    # KubeRay finds the dashboard (to submit the app) and builds the serve service from these names
    assert ports["dashboard"] == 8265 and ports["serve"] == SERVE_PROXY_PORT


def test_the_gateway_runs_beside_a_ray_node_of_its_own_and_is_ready_when_the_replicas_answer():
    pod = _groups()["gateway"]["template"]["spec"]
    ray_node, gateway = pod["containers"]  # KubeRay's Ray container must come first
    assert "command" not in ray_node  # KubeRay writes its `ray start`
    # KubeRay adds a readiness check of Serve's proxy unless the container has its own; no proxy runs here
    assert ray_node["readinessProbe"]["httpGet"] == {"path": "/api/healthz", "port": 52365}
    (volume,) = pod["volumes"]
    assert "emptyDir" in volume
    for container in (ray_node, gateway):
        assert {"name": volume["name"], "mountPath": "/tmp/ray"} in container["volumeMounts"]

    args, rest = cluster_parser().parse_known_args(_gateway_argv())
    (app,) = _serve_config().applications
    assert args.attach and args.address == "auto" and args.app_name == app.name
    assert args.replicas == app.args["replicas"]
    gateway_args = vars(build_parser().parse_args(["serve", *rest]))  # the rest are gateway flags
    port = gateway_args["gateway.port"]
    assert port not in (SERVE_PROXY_PORT, RAY_METRICS_PORT)  # the pod's network is shared with the Ray node
    assert gateway["ports"] == [{"containerPort": port, "name": "http"}]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "livenessProbe" not in gateway  # nothing listens while it waits for the app


def test_the_service_selects_the_gateway_pods_and_no_other():
    config = _rayservice()["spec"]["rayClusterConfig"]
    templates = {"headgroup": ("head", config["headGroupSpec"]["template"])}
    templates |= {name: ("worker", g["template"]) for name, g in _groups().items()}
    for _, template in templates.values():
        assert not set(template.get("metadata", {}).get("labels", {})) & set(KUBERAY_LABELS)
    service = _documents()["Service"]
    selector = service["spec"]["selector"].items()
    selected = {group for group, (node_type, template) in templates.items()
                if selector <= _pod_labels(template, node_type, group).items()}
    assert selected == {"gateway"}
    assert "ray.io/cluster" not in service["spec"]["selector"]  # KubeRay names the cluster; upgrades rename it
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"


def test_the_gateways_secrets_come_from_secrets_the_user_creates():
    """The salt secret (required) and the stored responses' database URL (optional: without it each gateway pod
    keeps its own SQLite file), with the driver that URL needs in the image."""
    (gateway,) = [c for c in _groups()["gateway"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    salt, responses_db = gateway["env"]
    assert salt == {"name": SALT_SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": "prefixgate-salt", "key": "secret"}}}
    assert responses_db == {"name": RESPONSES_DB_ENV, "valueFrom": {
        "secretKeyRef": {"name": "prefixgate-responses-db", "key": "url", "optional": True}}}
    assert "Secret" not in _documents()  # no secret value in the repository
    docs = (ROOT / "docs" / "scale-out.md").read_text()
    assert "kubectl create secret generic prefixgate-salt --from-literal=secret=" in docs
    assert "kubectl create secret generic prefixgate-responses-db --from-literal=url=postgresql://" in docs
    assert "pip install -e '.[cluster,postgres]'" in (ROOT / "deploy" / "Dockerfile").read_text()


def test_every_container_runs_the_image_of_this_version_built_as_documented():
    config = _rayservice()["spec"]["rayClusterConfig"]
    templates = [config["headGroupSpec"]["template"], *(g["template"] for g in config["workerGroupSpecs"])]
    containers = [c for t in templates for c in t["spec"]["containers"]]
    assert len(containers) == 4
    for container in containers:
        assert (container["image"], container["imagePullPolicy"]) == (IMAGE, "IfNotPresent")
    build = f"docker build -f deploy/Dockerfile -t {IMAGE} ."
    for text in ((ROOT / "deploy" / "Dockerfile").read_text(), (ROOT / "docs" / "scale-out.md").read_text()):
        assert build in text


def test_the_image_copies_every_package_it_installs_and_bakes_the_model_and_kernels():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = {line.split()[-2] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert copied == packages | {"pyproject.toml", "configs"}  # configs/default.yaml: the gateway's settings
    assert "PREFIXGATE_CACHE=/home/ray/.cache/prefixgate" in dockerfile
    assert "NUMBA_CACHE_DIR=/home/ray/.cache/prefixgate/numba" in dockerfile
    assert "python -m engine.model.default_model && python -m engine.model.compile" in dockerfile


def test_the_kernel_compiler_parses_its_arguments(monkeypatch):
    from engine.model import compile as compile_module

    calls = []

    def compile_kernels(model: str, dtype: str, kv_cache_dtype: str, quantized_activations: str,
                        quantization: str) -> float:
        calls.append((model, dtype, kv_cache_dtype, quantized_activations, quantization))
        return 1.0

    monkeypatch.setattr(compile_module, "compile_kernels", compile_kernels)
    assert compile_module.main([]) == 0
    assert compile_module.main(["--model", "/models/m", "--dtype", "bfloat16"]) == 0
    assert compile_module.main(["--dtype", "float32", "--kv-cache-dtype", "auto", "bfloat16"]) == 0
    assert compile_module.main(["--quantized-activations", "int8"]) == 0
    assert compile_module.main(["--quantization", "q8_0"]) == 0
    assert calls == [("default", "auto", "auto", "float32", "auto"),  # auto: as `serve` runs it
                     ("/models/m", "bfloat16", "auto", "float32", "auto"),
                     ("default", "float32", "auto", "float32", "auto"),  # one engine per K/V dtype
                     ("default", "float32", "bfloat16", "float32", "auto"), ("default", "auto", "auto", "int8", "auto"),
                     ("default", "auto", "auto", "float32", "q8_0")]
    with pytest.raises(SystemExit) as caught:
        compile_module.main(["--dtype", "float16"])
    assert caught.value.code == 2


def test_an_attached_gateway_waits_for_the_app_instead_of_exiting(caplog):
    """Before the Serve app exists `--attach` waits (nothing listens, so a readiness probe stays false);
    it used to exit 1, which KubeRay's start-up order turned into a deadlock."""
    import logging

    from ray.serve.exceptions import RayServeException

    from cluster.__main__ import wait_for_app

    class Serve:
        calls = 0

        def get_app_handle(self, name):
            self.calls += 1
            if self.calls < 4:
                raise RayServeException(f"Application '{name}' does not exist.")
            return f"handle of {name}"

    slept = []
    with caplog.at_level(logging.INFO, logger="prefixgate.cluster"):
        handle = wait_for_app(Serve(), "prefixgate", poll_s=2.0, log_every_s=4.0, sleep=slept.append)
    assert handle == "handle of prefixgate" and slept == [2.0, 2.0, 2.0]
    assert caplog.text.count("waiting for Serve app 'prefixgate'") == 2  # at 0 s and 4 s, not every poll
