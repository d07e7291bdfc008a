"""The MiniSGLModel operator against a real kube-apiserver + controller-manager (no kubelet: the tests write
pod statuses themselves, as a kubelet would)."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from cluster import cluster_fixture, namespace_fixture  # noqa: F401  (the `cluster` and `namespace` fixtures)
from control_plane import ADMIN_TOKEN
from k8s_utils import ROOT, find, helm_template, server_container, wait_for
from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError

pytestmark = pytest.mark.filterwarnings("ignore:Unverified HTTPS request")  # the test apiserver's own cert

API = "minisgl.io/v1alpha1"
STAMP = "2025-01-01T00:00:00Z"


# --- helpers -------------------------------------------------------------------------------------------------

def create_model(cluster, namespace: str, name: str, spec: dict) -> dict:
    body = {"apiVersion": API, "kind": "MiniSGLModel", "metadata": {"name": name}, "spec": spec}
    return cluster.dyn.create(cluster.res(API, "MiniSGLModel"), body=body, namespace=namespace).to_dict()


def get(cluster, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
    try:
        return cluster.res(api_version, kind).get(name=name, namespace=namespace).to_dict()
    except NotFoundError:
        return None


def model(cluster, namespace, name) -> dict:
    return get(cluster, API, "MiniSGLModel", namespace, name)


def deployment(cluster, namespace, name) -> dict | None:
    return get(cluster, "apps/v1", "Deployment", namespace, name)


def pods(cluster, namespace, name) -> list[dict]:
    items = cluster.res("v1", "Pod").get(namespace=namespace, label_selector=f"minisgl.io/model={name}").to_dict()
    return sorted(items["items"], key=lambda p: p["metadata"]["name"])


def status_where(cluster, namespace, name, check, what: str) -> dict:
    """The model's status once `check(status)` holds."""
    def probe():
        status = (model(cluster, namespace, name) or {}).get("status") or {}
        return status if check(status) else None
    return wait_for(what, probe, log=cluster.log)


def condition(status: dict, kind: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == kind)


def events(cluster, namespace, name) -> list[dict]:
    items = cluster.res("v1", "Event").get(namespace=namespace).to_dict()["items"]
    return [e for e in items if e["involvedObject"]["name"] == name and e["involvedObject"]["kind"] == "MiniSGLModel"]


def set_pod_status(cluster, pod: dict, status: dict) -> None:
    """What a kubelet would report (the status subresource; a merge patch replaces the lists whole)."""
    cluster.res("v1", "Pod").status.patch(body={"status": status}, name=pod["metadata"]["name"],
                                          namespace=pod["metadata"]["namespace"],
                                          content_type="application/merge-patch+json")


def running(ready: bool = True, waiting: dict | None = None, last: dict | None = None, restarts: int = 0) -> dict:
    state = {"waiting": waiting} if waiting else {"running": {"startedAt": STAMP}}
    flag = "True" if ready else "False"
    return {
        "phase": "Running", "startTime": STAMP,
        "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                       {"type": "ContainersReady", "status": flag}, {"type": "Ready", "status": flag}],
        "containerStatuses": [{"name": "minisgl", "ready": ready, "restartCount": restarts, "image": "minisgl",
                               "imageID": "", "state": state, "lastState": {"terminated": last} if last else {}}],
    }


def unschedulable(message: str) -> dict:
    return {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                               "message": message}]}


def arg(container: dict, flag: str) -> str:
    return container["args"][container["args"].index(flag) + 1]


# --- tests ---------------------------------------------------------------------------------------------------

def test_create_renders_the_chart_into_owned_children(cluster, namespace):
    spec = {"model": "Qwen/Qwen3-8B", "tp": 2, "replicas": 2,
            "image": {"repository": "registry.example/minisgl", "tag": "t1"}}
    owner = create_model(cluster, namespace, "qwen", spec)
    dep = wait_for("the Deployment", lambda: deployment(cluster, namespace, "qwen"), log=cluster.log)

    # The same pod as `helm install` of the chart with these values: one source for both.
    chart = find(helm_template({**spec, "fullnameOverride": "qwen", "commonLabels": {"minisgl.io/model": "qwen"}},
                               release="qwen", namespace=namespace), "Deployment")
    live, rendered = server_container(dep), server_container(chart)
    assert live["args"] == rendered["args"] and live["image"] == rendered["image"] == "registry.example/minisgl:t1"
    assert live["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert live["startupProbe"]["httpGet"]["path"] == rendered["startupProbe"]["httpGet"]["path"] == "/health"
    assert [v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]] == ["cache", "tmp", "shm"]
    assert dep["spec"]["strategy"]["type"] == "Recreate" and dep["spec"]["replicas"] == 2
    assert dep["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "minisgl-operator"

    svc = get(cluster, "v1", "Service", namespace, "qwen")
    assert svc["spec"]["ports"][0]["name"] == "http" and svc["spec"]["ports"][0]["targetPort"] == "http"
    for child in (dep, svc):
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
            ("MiniSGLModel", "qwen", owner["metadata"]["uid"], True)

    # The controller-manager makes the pods; nothing runs them, so the model is progressing, not ready.
    wait_for("two pods", lambda: len(pods(cluster, namespace, "qwen")) == 2, log=cluster.log)
    status = status_where(cluster, namespace, "qwen", lambda s: s.get("replicas") == 2, "status.replicas == 2")
    assert status["phase"] == "Progressing" and status["observedGeneration"] == 1
    assert condition(status, "Ready")["status"] == "False" and condition(status, "Degraded")["status"] == "False"
    assert status["url"] == f"http://qwen.{namespace}.svc:1919/v1"
    assert status["selector"] == "app.kubernetes.io/instance=qwen,app.kubernetes.io/name=minisgl"
    assert any(e["reason"] == "Applied" for e in events(cluster, namespace, "qwen"))


def test_spec_change_updates_the_deployment(cluster, namespace):
    create_model(cluster, namespace, "m", {"model": "Qwen/Qwen3-8B", "tp": 1})
    wait_for("the Deployment", lambda: deployment(cluster, namespace, "m"), log=cluster.log)
    cluster.res(API, "MiniSGLModel").patch(
        body={"spec": {"tp": 2, "args": ["--context-length", "8192"]}}, name="m", namespace=namespace,
        content_type="application/merge-patch+json")

    def updated():
        container = server_container(deployment(cluster, namespace, "m"))
        return arg(container, "--tp") == "2" and container["args"][-2:] == ["--context-length", "8192"] and \
            container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    wait_for("the Deployment on tp=2", updated, log=cluster.log)
    status_where(cluster, namespace, "m", lambda s: s.get("observedGeneration") == 2, "observedGeneration 2")


def test_hand_edits_of_children_are_reverted(cluster, namespace):
    create_model(cluster, namespace, "m", {"model": "Qwen/Qwen3-8B", "replicas": 1})
    dep = wait_for("the Deployment", lambda: deployment(cluster, namespace, "m"), log=cluster.log)
    image = server_container(dep)["image"]
    cluster.res("apps/v1", "Deployment").patch(
        body={"spec": {"replicas": 4, "template": {"spec": {"containers": [{"name": "minisgl", "image": "evil:1"}]}}}},
        name="m", namespace=namespace, content_type="application/strategic-merge-patch+json")

    def reverted():
        dep = deployment(cluster, namespace, "m")
        return dep["spec"]["replicas"] == 1 and server_container(dep)["image"] == image
    wait_for("the hand edit reverted", reverted, log=cluster.log)

    cluster.res("v1", "Service").delete(name="m", namespace=namespace)
    wait_for("the deleted Service recreated", lambda: get(cluster, "v1", "Service", namespace, "m"), log=cluster.log)


def test_scale_subresource_drives_the_deployment(cluster, namespace):
    """What `kubectl scale minisglmodel/m --replicas=3` and an HPA do: write /scale."""
    create_model(cluster, namespace, "m", {"model": "Qwen/Qwen3-8B"})
    status_where(cluster, namespace, "m", lambda s: s.get("selector"), "a selector in the status")
    scale = cluster.res(API, "MiniSGLModel").subresources["scale"]
    scale.patch(body={"spec": {"replicas": 3}}, name="m", namespace=namespace,
                content_type="application/merge-patch+json")
    wait_for("3 replicas", lambda: deployment(cluster, namespace, "m")["spec"]["replicas"] == 3, log=cluster.log)
    status_where(cluster, namespace, "m", lambda s: s.get("replicas") == 3, "3 pods counted")
    read = scale.get(name="m", namespace=namespace).to_dict()
    assert read["spec"]["replicas"] == 3 and read["status"]["replicas"] == 3
    assert read["status"]["selector"] == "app.kubernetes.io/instance=m,app.kubernetes.io/name=minisgl"


def test_status_follows_the_pods_and_is_never_ready_while_one_crash_loops(cluster, namespace):
    create_model(cluster, namespace, "m", {"model": "Qwen/Qwen3-8B", "replicas": 2})
    first, second = wait_for("two pods", lambda: (lambda p: p if len(p) == 2 else None)(pods(cluster, namespace, "m")),
                             log=cluster.log)
    for pod in (first, second):
        set_pod_status(cluster, pod, running())
    status = status_where(cluster, namespace, "m", lambda s: s.get("phase") == "Ready", "Ready")
    assert condition(status, "Ready")["status"] == "True" and status["readyReplicas"] == 2
    assert condition(status, "Progressing")["status"] == "False"

    # A pod whose readiness still says True while its container is in CrashLoopBackOff after an OOM kill:
    # the Deployment counts it ready; the model must not.
    oom = {"reason": "OOMKilled", "exitCode": 137, "startedAt": STAMP, "finishedAt": STAMP}
    set_pod_status(cluster, second, running(ready=True, waiting={"reason": "CrashLoopBackOff"}, last=oom, restarts=4))
    status = status_where(cluster, namespace, "m", lambda s: s.get("phase") == "Degraded", "Degraded")
    assert deployment(cluster, namespace, "m")["status"]["readyReplicas"] == 2
    assert condition(status, "Ready")["status"] == "False" and condition(status, "Degraded")["reason"] == "OOMKilled"
    assert status["lastFailure"]["reason"] == "OOMKilled" and status["lastFailure"]["pod"] == second["metadata"]["name"]
    assert "4 restart(s)" in status["lastFailure"]["message"]

    set_pod_status(cluster, second, running())
    status = status_where(cluster, namespace, "m", lambda s: s.get("phase") == "Ready", "Ready again")
    assert status["lastFailure"]["reason"] == "OOMKilled"  # kept, as the last failure seen

    set_pod_status(cluster, first, unschedulable("0/3 nodes are available: 3 Insufficient nvidia.com/gpu."))
    status = status_where(cluster, namespace, "m", lambda s: s.get("phase") == "Degraded", "Degraded again")
    assert condition(status, "Degraded")["reason"] == "InsufficientGPU"
    assert "Insufficient nvidia.com/gpu" in status["lastFailure"]["message"]

    reasons = [(e["type"], e["reason"]) for e in events(cluster, namespace, "m")]
    assert ("Normal", "Ready") in reasons and ("Warning", "OOMKilled") in reasons
    assert ("Warning", "InsufficientGPU") in reasons


@pytest.mark.parametrize("spec,field", [
    ({"model": "Qwen/Qwen3-8B", "tp": 0}, "spec.tp"),
    ({"model": "Qwen/Qwen3-8B", "tp": "two"}, "spec.tp"),
    ({"model": "Qwen/Qwen3-8B", "replicas": -1}, "spec.replicas"),
    ({"model": "Qwen/Qwen3-8B", "strategy": "BlueGreen"}, "spec.strategy"),
    ({"model": "Qwen/Qwen3-8B", "device": "tpu"}, "spec.device"),
    ({"model": "not a model id"}, "spec.model"),
    ({"tp": 1}, "spec.model"),  # nothing to serve: neither a model nor demo: true
    ({"demo": False}, "spec.demo"),
])
def test_invalid_resource_is_rejected_by_the_crd_schema(cluster, namespace, spec, field):
    with pytest.raises(DynamicApiError) as err:
        create_model(cluster, namespace, "bad", spec)
    assert err.value.status == 422 and field in err.value.summary()


def test_a_demo_resource_needs_no_model(cluster, namespace):
    create_model(cluster, namespace, "d", {"demo": True, "device": "cpu"})
    dep = wait_for("the Deployment", lambda: deployment(cluster, namespace, "d"), log=cluster.log)
    assert server_container(dep)["args"][0] == "--demo"


def test_spec_the_chart_refuses_is_degraded_not_applied(cluster, namespace):
    name = "m" + "x" * 55  # a valid object name, too long for the Service and pod names the chart derives
    create_model(cluster, namespace, name, {"model": "Qwen/Qwen3-8B"})
    status = status_where(cluster, namespace, name, lambda s: s.get("phase") == "Degraded", "Degraded")
    assert condition(status, "Degraded")["reason"] == "InvalidSpec" and status["observedGeneration"] == 0
    assert deployment(cluster, namespace, name) is None


def test_deleting_the_model_garbage_collects_its_children(cluster, namespace):
    create_model(cluster, namespace, "m", {"model": "Qwen/Qwen3-8B"})
    wait_for("the children", lambda: deployment(cluster, namespace, "m") and
             get(cluster, "v1", "Service", namespace, "m"), log=cluster.log)
    wait_for("a pod", lambda: pods(cluster, namespace, "m"), log=cluster.log)
    cluster.res(API, "MiniSGLModel").delete(name="m", namespace=namespace)
    wait_for("the children gone", lambda: deployment(cluster, namespace, "m") is None and
             get(cluster, "v1", "Service", namespace, "m") is None and not pods(cluster, namespace, "m"),
             log=cluster.log)


def test_example_is_accepted_and_a_missing_monitoring_stack_is_reported(cluster, namespace):
    """The shipped example passes the CRD; it asks for a PodMonitor, which this cluster (no Prometheus
    Operator) does not serve: the Deployment and Service still apply, and the status says what failed."""
    example = yaml.safe_load((ROOT / "operator/deploy/example-qwen3-30b-a3b.yaml").read_text())
    name = example["metadata"]["name"]
    create_model(cluster, namespace, name, example["spec"])
    status = status_where(cluster, namespace, name, lambda s: s.get("phase") == "Degraded", "Degraded")
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "ApplyFailed" and "PodMonitor" in degraded["message"]
    dep = deployment(cluster, namespace, name)
    assert server_container(dep)["resources"]["limits"] == {"nvidia.com/gpu": "2", "memory": "160Gi"}
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == example["spec"]["nodeSelector"]

    # Pods becoming ready do not hide the failure: the status that counts them still says Degraded.
    for pod in wait_for("two pods", lambda: (lambda p: p if len(p) == 2 else None)(pods(cluster, namespace, name))):
        set_pod_status(cluster, pod, running())
    status = status_where(cluster, namespace, name, lambda s: s.get("readyReplicas") == 2, "2 ready pods counted")
    assert status["phase"] == "Degraded" and condition(status, "Degraded")["reason"] == "ApplyFailed"


def test_an_option_switched_off_deletes_its_object(cluster, namespace):
    create_model(cluster, namespace, "m", {"model": "Qwen/Qwen3-8B", "podDisruptionBudget": {"enabled": True}})
    wait_for("the PodDisruptionBudget", lambda: get(cluster, "policy/v1beta1", "PodDisruptionBudget", namespace, "m"),
             log=cluster.log)
    cluster.res(API, "MiniSGLModel").patch(body={"spec": {"podDisruptionBudget": {"enabled": False}}}, name="m",
                                           namespace=namespace, content_type="application/merge-patch+json")
    wait_for("the PodDisruptionBudget deleted",
             lambda: get(cluster, "policy/v1beta1", "PodDisruptionBudget", namespace, "m") is None, log=cluster.log)
    assert deployment(cluster, namespace, "m") is not None


def test_helm_install_on_the_api_server(cluster, namespace):
    """`helm install` itself (not only `helm template`): the issue's command creates the objects; a bad value
    fails the install with the field's name and creates nothing."""
    env = {**os.environ, "KUBECONFIG": str(cluster.plane.kubeconfig(ADMIN_TOKEN))}
    base = ["helm", "install", "minisgl", str(ROOT / "helm"), "--namespace", namespace]
    bad = subprocess.run([*base, "--set", "model=Qwen/Qwen3-30B-A3B", "--set", "tp=0"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "tp: Must be greater than or equal to 1" in bad.stderr
    assert deployment(cluster, namespace, "minisgl") is None

    preset = str(ROOT / "helm/values-qwen3-30b-a3b.yaml")
    done = subprocess.run([*base, "--set", "model=Qwen/Qwen3-30B-A3B", "-f", preset], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert f"http://minisgl.{namespace}.svc:1919/v1" in done.stdout  # NOTES.txt
    container = server_container(deployment(cluster, namespace, "minisgl"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2" and arg(container, "--tp") == "2"
    assert get(cluster, "v1", "Service", namespace, "minisgl")["spec"]["ports"][0]["name"] == "http"
