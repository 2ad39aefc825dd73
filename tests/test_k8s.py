"""deploy/k8s: each overlay renders with `kubectl kustomize` (offline), every rendered object
validates against the Kubernetes schemas (kubernetes-validate, strict) and the ScaledObject against
KEDA's CRD schema (tests/data: a hand-written subset, see its $comment); the manifests name only
commands, flags, settings, routes and metrics wicore has. Skipped without kubectl."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_deploy import cli_command
from wicore.config import Settings
from wicore.gateway.metrics import PREFIX

jsonschema = pytest.importorskip("jsonschema")  # the test extra; absent on a bare GPU image

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
KUBERNETES = "1.33.0"  # the API version the manifests are checked against
KEDA_SCHEMA = Path(__file__).parent / "data" / "keda-scaledobject.schema.json"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def rendered(overlay: str) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    keda = json.loads(KEDA_SCHEMA.read_text())
    objects = rendered(overlay)
    for obj in objects:
        if obj["kind"] == "ScaledObject":
            jsonschema.validate(obj, keda)
        else:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Service", "ConfigMap", "ScaledObject", "PersistentVolumeClaim"} <= kinds
    assert ("redis" in by_kind(objects, "Deployment")) == (overlay == "in-cluster-redis")


def test_workers_take_a_gpu_each_their_model_from_a_volume_and_probes_on_the_metrics_port():
    objects = rendered("in-cluster-redis")
    worker = by_kind(objects, "Deployment")["wicore-worker"]["spec"]["template"]
    [container] = worker["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["wicore", "worker"] and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    flags = {p.opts[0] for p in cli_command(["worker"]).params if getattr(p, "opts", None)}
    assert {word for word in command if word.startswith("--")} <= flags
    port = int(command[command.index("--metrics-port") + 1])
    assert worker["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert container["ports"][0]["containerPort"] == port
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    model = command[command.index("--model") + 1]
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == model]
    [volume] = [v for v in worker["spec"]["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] and volume["persistentVolumeClaim"]["claimName"] in by_kind(
        objects, "PersistentVolumeClaim"
    )


def test_settings_in_the_manifests_exist():
    settings = {"WICORE_" + name.upper() for name in Settings.model_fields}
    for overlay in OVERLAYS:
        objects = rendered(overlay)
        config = by_kind(objects, "ConfigMap")["wicore-config"]["data"]
        assert set(config) <= settings, set(config) - settings
        for deployment in by_kind(objects, "Deployment").values():
            for container in deployment["spec"]["template"]["spec"]["containers"]:
                names = {e["name"] for e in container.get("env", [])}
                assert not {n for n in names if n.startswith("WICORE_")} - settings


def test_keda_scales_the_workers_to_zero_on_a_metric_the_gateway_exports():
    objects = rendered("in-cluster-redis")
    scaled = by_kind(objects, "ScaledObject")["wicore-worker"]["spec"]
    assert scaled["scaleTargetRef"]["name"] in by_kind(objects, "Deployment")
    assert scaled["minReplicaCount"] == 0
    [trigger] = scaled["triggers"]
    assert f"{PREFIX}queue_jobs" in trigger["metadata"]["query"]
    host = trigger["metadata"]["serverAddress"].split("//")[1].split(":")[0]
    assert host in by_kind(objects, "Service"), "the trigger reads the Prometheus Service"
    gateway = by_kind(objects, "Deployment")["wicore-gateway"]["spec"]["template"]
    assert gateway["metadata"]["annotations"]["prometheus.io/scrape"] == "true", "the gateway exports the queue depth"
    assert by_kind(objects, "ConfigMap")["wicore-grafana-dashboard"]["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_compose_and_kubernetes_run_the_two_images_the_dockerfile_builds():
    """The Dockerfile documents `wicore:cpu` and `wicore:cuda` (VARIANT=cuda); nothing here can
    build it (no container daemon), so its tags and variants are checked as text."""
    dockerfile = (K8S.parents[1] / "Dockerfile").read_text()
    assert "docker build -t wicore:cpu ." in dockerfile
    assert "docker build -t wicore:cuda --build-arg VARIANT=cuda ." in dockerfile
    assert "cpu) wheels=cpu" in dockerfile and 'cuda) wheels="$CUDA_WHEELS"' in dockerfile
    built = {"wicore:cpu", "wicore:cuda"}
    services = yaml.safe_load((K8S.parent / "compose.yaml").read_text())["services"]
    assert {services["gateway"]["image"], services["worker"]["image"]} == built
    deployments = by_kind(rendered("in-cluster-redis"), "Deployment")
    images = {deployments[name]["spec"]["template"]["spec"]["containers"][0]["image"] for name in
              ("wicore-gateway", "wicore-worker")}  # fmt: skip
    assert images == built and deployments["wicore-worker"]["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "wicore:cuda"
    )
