"""The chart on a real one-node cluster: `helm install` of the CPU demo server, its pod Ready through the
probes, OpenAI requests through the Service, /metrics from the pod, `helm test`, a rolling `helm upgrade`
that fails no request, and `helm uninstall` leaving nothing. The tests run in file order on one release."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from node_cluster import CHART, Node, node_fixture, wait_until  # noqa: F401  (the `node` fixture)
from prometheus_client.parser import text_string_to_metric_families

NS, RELEASE = "chart", "chat"
FULLNAME = f"{RELEASE}-minisgl"  # the chart's object names
VALUES = ["--set", "demo=true,device=cpu"]


def pods(node: Node) -> list[dict]:
    return node.get("pods", "-n", NS, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


@pytest.fixture(scope="module", name="release")
def release_fixture(node: Node) -> str:
    """The installed release's Service URL; installed once, uninstalled by the last test (or here)."""
    node.helm("install", RELEASE, str(CHART), "-n", NS, "--create-namespace", *VALUES, "--wait", "--timeout", "240s")
    yield node.service_url(NS, FULLNAME)
    node.helm("uninstall", RELEASE, "-n", NS, check=False)


def test_install_gets_a_ready_pod_through_its_probes(node, release):
    [pod] = pods(node)
    assert ready(pod)
    container = pod["spec"]["containers"][0]
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["args"][:2] == ["--demo", "--served-model-name"]
    [status] = pod["status"]["containerStatuses"]
    assert status["restartCount"] == 0 and status["image"].endswith("minisgl:0.1.0-cpu")


def test_chat_completion_through_the_service(node, release):
    # kube-proxy may program the Service a moment after the pod turns Ready: retry the first connection only.
    wait_until("the Service to answer", lambda: httpx.get(f"{release}/health", timeout=5).status_code == 200)
    client = openai.OpenAI(base_url=f"{release}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["demo"]
    out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello there"}],
                                         max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens >= 1 and out.usage.prompt_tokens >= 3


def test_metrics_scraped_from_the_pod(node, release):
    [pod] = pods(node)
    url = f"http://{pod['status']['podIP']}:{pod['spec']['containers'][0]['ports'][0]['containerPort']}/metrics"
    text = httpx.get(url, timeout=10).raise_for_status().text
    samples = {(s.name, s.labels.get("model_name")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    # the completion of the test before (or nothing, when run alone: then at least the series exist)
    assert ("sglang:prompt_tokens_total", "demo") in samples
    assert ("sglang:num_running_reqs", "demo") in samples


def test_helm_test_passes_and_its_pod_is_deleted(node, release):
    done = node.helm("test", RELEASE, "-n", NS, "--timeout", "180s")
    assert "Phase:          Succeeded" in done.stdout, done.stdout
    # hook-delete-policy hook-succeeded: the test pod goes once it passed
    assert f"pod/{FULLNAME}-test" not in node.kubectl("get", "pods", "-n", NS, "-o", "name").stdout


def test_rolling_upgrade_fails_no_request(node, release):
    """A changed value rolls the pod (surge 1, unavailable 0); requests keep flowing through the Service the
    whole time: the new pod gets traffic only once Ready, the old one serves through its preStop sleep
    while kube-proxy drops its endpoint, then drains what it still has."""
    [old] = pods(node)
    results: list[str] = []
    stop = threading.Event()

    def load() -> None:
        # a new connection per request, as the Service balances connections, not requests
        while not stop.is_set():
            try:
                r = httpx.post(f"{release}/v1/completions", headers={"Connection": "close"}, timeout=60,
                               json={"model": "demo", "prompt": "roll", "max_tokens": 4, "temperature": 0})
                results.append("ok" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as exc:
                results.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        node.helm("upgrade", RELEASE, str(CHART), "-n", NS, *VALUES, "--set", "drainTimeoutSeconds=20",
                  "--wait", "--timeout", "240s")
        wait_until("the old pod gone", lambda: old["metadata"]["uid"] not in
                   {p["metadata"]["uid"] for p in pods(node)}, node=node, timeout=120)
    finally:
        stop.set()
        for t in threads:
            t.join()
    [new] = pods(node)
    args = new["spec"]["containers"][0]["args"]
    assert ready(new) and args[args.index("--shutdown-timeout") + 1] == "20"
    failed = [r for r in results if r != "ok"]
    assert len(results) >= 10 and not failed, f"{len(failed)} of {len(results)} failed: {failed[:5]}"


def test_uninstall_leaves_nothing(node, release):
    node.helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "120s")
    baseline = ("configmap/kube-root-ca.crt", "secret/default-token-")  # every namespace has these

    def left() -> list[str]:  # `all`: pods, Services, Deployments, ReplicaSets; Secrets: helm's release records
        names = node.kubectl("get", "all,configmaps,secrets", "-n", NS, "-o", "name").stdout.split()
        return [n for n in names if not n.startswith(baseline)]

    wait_until("nothing left", lambda: not left(), node=node, timeout=120)
