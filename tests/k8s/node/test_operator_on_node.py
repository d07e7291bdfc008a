"""The operator on a real one-node cluster: installed by the chart (operator.enabled) into a pod with its
ServiceAccount and RBAC, it turns MiniSGLModels into Ready pods and keeps their status true through
`kubectl scale`, a killed pod and a server that cannot start; the CRD refuses a bad spec, and deleting a
resource deletes what it owns. The tests run in file order on one operator."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from node_cluster import CHART, Node, node_fixture, wait_until  # noqa: F401  (the `node` fixture)

NS = "models"


def apply(node: Node, name: str, spec: dict, check: bool = True):
    body = {"apiVersion": "minisgl.io/v1alpha1", "kind": "MiniSGLModel", "metadata": {"name": name, "namespace": NS},
            "spec": spec}
    return node.kubectl("apply", "-f", "-", stdin=json.dumps(body), check=check)


def status(node: Node, name: str) -> dict:
    return node.get("minisglmodel", name, "-n", NS).get("status") or {}


def pods(node: Node, name: str) -> list[dict]:
    return node.get("pods", "-n", NS, "-l", f"minisgl.io/model={name}")["items"]


def ready_pods(node: Node, name: str) -> list[str]:
    return [p["metadata"]["name"] for p in pods(node, name) if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]


def columns(node: Node, name: str) -> dict[str, str]:
    """`kubectl get msm NAME -o wide`: the printer columns, as a user sees them."""
    header, row = node.kubectl("get", "msm", name, "-n", NS, "-o", "wide").stdout.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]  # columns are aligned under their titles
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, [*starts[1:], None])}


@pytest.fixture(scope="module", name="operator", autouse=True)
def operator_fixture(node: Node):
    node.helm("install", "op", str(CHART), "-n", "minisgl-system", "--create-namespace",
              "--set", "operator.enabled=true", "--wait", "--timeout", "180s")
    node.kubectl("create", "namespace", NS)
    yield
    node.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    node.helm("uninstall", "op", "-n", "minisgl-system", check=False)


def test_a_model_becomes_ready_pods_and_true_status_columns(node):
    apply(node, "demo", {"demo": True, "device": "cpu"})
    wait_until("phase Ready", lambda: status(node, "demo").get("phase") == "Ready", node=node, timeout=240)
    assert len(ready_pods(node, "demo")) == 1
    cols = columns(node, "demo")
    assert (cols["READY"], cols["PHASE"], cols["DESIRED"]) == ("1", "Ready", "1")
    assert cols["URL"] == "http://demo.models.svc:1919/v1"
    # the URL's Service answers (by its ClusterIP: the host does not use the cluster's DNS)
    url = node.service_url(NS, "demo")
    wait_until("the Service to answer", lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="demo", prompt="operator", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_kubectl_scale_goes_through_the_scale_subresource(node):
    node.kubectl("scale", "msm/demo", "-n", NS, "--replicas=2")
    assert node.get("msm", "demo", "-n", NS)["spec"]["replicas"] == 2  # /scale wrote the spec
    wait_until("2 ready pods", lambda: status(node, "demo").get("readyReplicas") == 2
               and status(node, "demo").get("phase") == "Ready", node=node, timeout=240)
    assert node.get("deployment", "demo", "-n", NS)["spec"]["replicas"] == 2
    assert len(ready_pods(node, "demo")) == 2 and columns(node, "demo")["READY"] == "2"


def test_a_killed_pod_is_replaced_and_the_status_shows_it(node):
    victim, survivor = sorted(ready_pods(node, "demo"))
    node.kubectl("delete", "pod", victim, "-n", NS, "--grace-period=0", "--force")
    degraded = wait_until("the status to count one pod ready", lambda: (s := status(node, "demo")).get(
        "readyReplicas") == 1 and s, node=node, timeout=60, interval=0.2)
    assert degraded["phase"] != "Ready"
    wait_until("a replacement Ready", lambda: status(node, "demo").get("phase") == "Ready"
               and len(ready_pods(node, "demo")) == 2, node=node, timeout=240)
    assert victim not in ready_pods(node, "demo") and survivor in ready_pods(node, "demo")


def test_a_bad_spec_is_refused_by_the_crd_schema(node):
    done = apply(node, "bad", {"demo": True, "device": "cpu", "tp": 0}, check=False)
    assert done.returncode != 0 and "spec.tp" in done.stderr, done.stderr
    done = apply(node, "bad", {"device": "cpu"}, check=False)  # nothing to serve
    assert done.returncode != 0 and "spec.model" in done.stderr, done.stderr
    assert node.kubectl("get", "msm", "bad", "-n", NS, check=False).returncode != 0


def test_a_server_that_cannot_start_says_why_in_status_and_events(node):
    apply(node, "broken", {"model": "/models/missing", "device": "cpu"})
    s = wait_until("phase Degraded", lambda: (s := status(node, "broken")).get("phase") == "Degraded" and s,
                   node=node, timeout=180)
    failure = s["lastFailure"]
    assert failure["reason"] == "CrashLoopBackOff"
    assert "ModelLoadError" in failure["message"] and "/models/missing" in failure["message"], failure
    events = node.get("events", "-n", NS, "--field-selector", "involvedObject.name=broken")["items"]
    warnings = [e for e in events if e["type"] == "Warning" and e["involvedObject"]["kind"] == "MiniSGLModel"]
    assert any("ModelLoadError" in e["message"] for e in warnings), events
    [pod] = pods(node, "broken")
    [cs] = pod["status"]["containerStatuses"]
    assert "/models/missing" in cs["lastState"]["terminated"]["message"]  # FallbackToLogsOnError
    node.kubectl("delete", "msm", "broken", "-n", NS)


def test_deleting_the_resource_deletes_what_it_owns(node):
    node.kubectl("delete", "msm", "demo", "-n", NS)
    wait_until("the children gone", lambda: not node.kubectl(
        "get", "deployments,services,replicasets,pods", "-n", NS, "-l", "minisgl.io/model=demo", "-o", "name"
    ).stdout.strip(), node=node, timeout=180)
