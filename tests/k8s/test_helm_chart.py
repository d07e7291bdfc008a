"""The Helm chart: lint, valid objects for current Kubernetes, and what the rendered objects promise
(GPUs = TP, /dev/shm only with TP > 1, probes that cannot kill a loading or busy server, the strategy,
secrets, metrics names) and what the values schema refuses."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from k8s_utils import CHART, find, helm_error, helm_template, kinds, server_container

from minisgl.server.metrics import Metrics

ALL_OPTIONS = {
    "model": "pvc://models/qwen3/Qwen3-8B", "tp": 4, "replicas": 2,
    "apiKeySecret": {"name": "minisgl-api"}, "hfTokenSecret": {"name": "hf", "key": "token"},
    "cache": {"existingClaim": "hf-cache"}, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
    "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
    "autoscaling": {"enabled": True}, "podDisruptionBudget": {"enabled": True},
    "grafanaDashboard": {"enabled": True}, "operator": {"enabled": True},
    "nodeSelector": {"gpu": "h100"}, "priorityClassName": "high", "runtimeClassName": "nvidia",
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
}
VALUE_SETS = {  # name -> (values files in helm/, values)
    "default": ((), {"model": "Qwen/Qwen3-30B-A3B"}),
    "qwen3-30b-a3b-tp2": (("values-qwen3-30b-a3b.yaml",), {"model": "Qwen/Qwen3-30B-A3B"}),
    "small": (("values-qwen3-0.6b.yaml",), {}),
    "cpu-demo": ((), {"demo": True, "device": "cpu"}),
    "all-options": ((), ALL_OPTIONS),
    "all-options-hpa": ((), {**ALL_OPTIONS, "autoscaling": {"enabled": True, "kind": "hpa"}}),
}


def deployment(values: dict, *files: str) -> dict:
    return find(helm_template(values, *files), "Deployment", "minisgl")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict(name):
    files, values = VALUE_SETS[name]
    cmd = ["helm", "lint", "--strict", str(CHART), *[a for f in files for a in ("-f", str(CHART / f))], "-f", "-"]
    done = subprocess.run(cmd, input=json.dumps(values), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rendered_objects_are_valid_for_current_kubernetes(tmp_path):
    paths = []
    for name, (files, values) in VALUE_SETS.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(helm_template(values, *files)))
        paths.append(str(path))
    done = subprocess.run(["kubernetes-validate", "--strict", "--quiet", "-k", "1.30.0", *paths],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "error" not in (done.stdout + done.stderr).lower()


def test_issue_command_serves_the_model_on_two_gpus():
    """helm install minisgl ./helm --set model=Qwen/Qwen3-30B-A3B -f helm/values-qwen3-30b-a3b.yaml"""
    objects = helm_template({"model": "Qwen/Qwen3-30B-A3B"}, "values-qwen3-30b-a3b.yaml")
    assert kinds(objects) == ["Deployment", "Pod", "Service"]  # the Pod is the `helm test` hook
    args = server_container(find(objects, "Deployment"))["args"]
    assert args[args.index("--model") + 1] == "Qwen/Qwen3-30B-A3B"
    assert args[args.index("--tp") + 1] == "2"
    assert args[args.index("--host") + 1] == "0.0.0.0"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpu_count_is_tp_and_shm_only_with_tp_above_one(tp):
    dep = deployment({"model": "Qwen/Qwen3-8B", "tp": tp, "resources": {"limits": {"memory": "64Gi"}}})
    pod, container = dep["spec"]["template"]["spec"], server_container(dep)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": str(tp), "memory": "64Gi"}
    assert container["args"][container["args"].index("--tp") + 1] == str(tp)
    shm = [v for v in pod["volumes"] if v["name"] == "shm"]
    mounted = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    if tp > 1:
        assert shm == [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]
        assert mounted == [{"name": "shm", "mountPath": "/dev/shm"}]
    else:
        assert shm == [] and mounted == []
    assert "hostIPC" not in pod


def test_cpu_device_requests_no_gpu_and_rolls():
    dep = deployment({"demo": True, "device": "cpu"})
    container = server_container(dep)
    assert "resources" not in container
    assert container["image"] == "minisgl:0.1.0-cpu"
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert container["args"][:4] == ["--demo", "--served-model-name", "demo", "--device"]


def test_probes_allow_a_long_load_and_never_kill_a_busy_server():
    container = server_container(deployment({"model": "Qwen/Qwen3-8B"}))
    startup, ready, live = container["startupProbe"], container["readinessProbe"], container["livenessProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    assert ready["httpGet"] == {"path": "/health", "port": "http"}
    # /health is 503 while draining and /health_generate needs the scheduler: liveness uses neither.
    assert live == {"tcpSocket": {"port": "http"}, "periodSeconds": 15, "timeoutSeconds": 10, "failureThreshold": 8}
    assert [p["name"] for p in container["ports"]] == ["http"]

    custom = server_container(deployment({"model": "Qwen/Qwen3-8B", "probes": {"startupTimeoutSeconds": 7200}}))
    assert custom["startupProbe"]["periodSeconds"] * custom["startupProbe"]["failureThreshold"] == 7200


def test_shutdown_budget_covers_prestop_and_drain():
    dep = deployment({"model": "Qwen/Qwen3-8B", "drainTimeoutSeconds": 120, "preStopSleepSeconds": 10})
    pod, container = dep["spec"]["template"]["spec"], server_container(dep)
    assert container["args"][container["args"].index("--shutdown-timeout") + 1] == "120"
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert pod["terminationGracePeriodSeconds"] > 120 + 10


@pytest.mark.parametrize("values,expected", [
    ({"model": "a/b"}, "Recreate"),
    ({"model": "a/b", "strategy": "RollingUpdate"}, "RollingUpdate"),
    ({"model": "a/b", "device": "cpu", "strategy": "Recreate"}, "Recreate"),
])
def test_strategy_recreate_for_gpu_pods_by_default(values, expected):
    assert deployment(values)["spec"]["strategy"]["type"] == expected


def test_pod_is_restricted_and_without_service_links():
    pod = deployment({"model": "a/b"})["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sec = pod["containers"][0]["securityContext"]
    assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"] == {"drop": ["ALL"]}
    assert sec["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {"/home/minisgl/.cache", "/tmp"} <= mounts  # what the server writes


def test_secrets_are_referenced_for_token_and_api_key():
    dep = deployment({"model": "meta-llama/Llama-3.1-8B", "hfTokenSecret": {"name": "hf"},
                      "apiKeySecret": {"name": "keys", "key": "minisgl"}})
    container = server_container(dep)
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env == {"HF_TOKEN": {"name": "hf", "key": "token"}, "MINISGL_API_KEY": {"name": "keys", "key": "minisgl"}}
    assert container["args"][container["args"].index("--api-key") + 1] == "$(MINISGL_API_KEY)"


def test_pvc_model_and_cache_claim():
    dep = deployment({"model": "pvc://weights/qwen/Qwen3-8B", "cache": {"existingClaim": "hf-cache"}})
    pod, container = dep["spec"]["template"]["spec"], server_container(dep)
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/qwen/Qwen3-8B"
    assert args[args.index("--served-model-name") + 1] == "qwen/Qwen3-8B"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert volumes["cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]


def test_pinned_revision_is_fetched_before_the_server_starts():
    dep = deployment({"model": "hf://Qwen/Qwen3-8B", "revision": "v1.0"})
    pod, container = dep["spec"]["template"]["spec"], server_container(dep)
    (fetch,) = pod["initContainers"]
    target = "/home/minisgl/.cache/minisgl-models/Qwen/Qwen3-8B/v1.0"
    assert fetch["args"][1:] == ["Qwen/Qwen3-8B", "v1.0", target]
    assert container["args"][container["args"].index("--model") + 1] == target
    assert container["args"][container["args"].index("--served-model-name") + 1] == "Qwen/Qwen3-8B"


def test_service_has_named_http_port():
    svc = find(helm_template({"model": "a/b", "service": {"port": 8000}}), "Service")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "minisgl", "app.kubernetes.io/instance": "minisgl"}


def test_optional_objects_off_by_default_and_all_on():
    assert kinds(helm_template({"model": "a/b", "tests": {"enabled": False}})) == ["Deployment", "Service"]
    objects = helm_template(ALL_OPTIONS)
    assert kinds(objects) == sorted([
        "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding", "ConfigMap",
        "CustomResourceDefinition", "Deployment", "Deployment", "Pod", "PodDisruptionBudget", "PodMonitor",
        "ScaledObject", "Service", "ServiceAccount", "ServiceMonitor"])
    scaled = find(objects, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "minisgl"}
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    assert trigger["query"] == 'sum(sglang:num_queue_reqs{namespace="default",model_name="qwen3/Qwen3-8B"})'
    assert "replicas" not in find(objects, "Deployment", "minisgl")["spec"]  # the autoscaler owns it
    assert find(objects, "PodDisruptionBudget")["apiVersion"] == "policy/v1"


def test_pdb_api_version_follows_the_cluster():
    values = {"model": "a/b", "podDisruptionBudget": {"enabled": True}}
    objects = helm_template(values, extra=("--kube-version", "1.20.2"))
    assert find(objects, "PodDisruptionBudget")["apiVersion"] == "policy/v1beta1"


def test_dashboard_and_autoscaler_use_metric_names_the_server_exports():
    exported = {m.name for m in Metrics("x").registry.collect()}  # prometheus_client strips _total from counters
    series = exported | {f"{n}_total" for n in exported} | {f"{n}_bucket" for n in exported}
    dashboard = json.loads(find(helm_template(ALL_OPTIONS), "ConfigMap")["data"]["minisgl.json"])
    used = {name for panel in dashboard["panels"] for t in panel["targets"]
            for name in _metric_names(t["expr"])}
    assert used and used <= series, used - series
    assert "sglang:num_queue_reqs" in exported


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"sglang:[a-z0-9_]+", expr))


@pytest.mark.parametrize("values,field", [
    ({"model": "a/b", "tp": 0}, "tp"),
    ({"model": "a/b", "tp": "two"}, "tp"),
    ({"model": "a/b", "strategy": "BlueGreen"}, "strategy"),
    ({"model": "a/b", "device": "tpu"}, "device"),
    ({"model": "not a model"}, "model"),
    ({"model": "a/b", "probes": {"startupTimeoutSeconds": 10}}, "startupTimeoutSeconds"),
    ({"model": "a/b", "shm": {"sizeLimit": "lots"}}, "sizeLimit"),
    ({"model": "a/b", "replica": 2}, "replica"),
    ({"model": "a/b", "probes": {"startup": 60}}, "startup"),
])
def test_schema_rejects_bad_values_naming_the_field(values, field):
    assert field in helm_error(values)


def test_nothing_to_serve_is_a_clear_error():
    assert "nothing to serve: set model" in helm_error({})


def test_operator_install_renders_crd_rbac_and_no_model():
    objects = helm_template({"operator": {"enabled": True}})
    assert kinds(objects) == sorted(["ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
                                     "CustomResourceDefinition", "Deployment", "ServiceAccount"])
    crd = find(objects, "CustomResourceDefinition")
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    values_schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    for field, schema in spec["properties"].items():  # every spec field is a chart value of the same type
        assert schema.get("type") == values_schema[field].get("type"), field
    assert "operator" not in spec["properties"] and "autoscaling" not in spec["properties"]

    namespaced = helm_template({"operator": {"enabled": True, "watchNamespace": "ml"}})
    role = find(namespaced, "Role")
    assert role["metadata"]["namespace"] == "ml"
    verbs = {(g, r): rule["verbs"] for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert verbs[("", "pods")] == ["get", "list", "watch"]  # it reads pods, never writes them
    assert "delete" not in verbs[("minisgl.io", "minisglmodels")]
