"""The one-node cluster for the node tests: started once per session by tests/k8s/start-cluster.sh and
stopped by stop-cluster.sh, which puts the machine back. Tests drive it the way a user would, through
kubectl and helm. (Not a conftest.py: the suite's own conftest module must stay the only `conftest`.)

Runs only with MINISGL_K8S_NODE=1, as root, after build-binaries.sh and build-images.sh: it changes the
host's network (a bridge, routes, iptables rules), which nobody should get from a plain `pytest`."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

K8S = Path(__file__).resolve().parents[1]
ROOT = K8S.parents[1]
CHART = ROOT / "helm"


@dataclass
class Node:
    kubeconfig: str

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": self.kubeconfig}

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["kubectl", *args], env=self.env(), input=stdin, capture_output=True, text=True,
                              check=check, timeout=120)

    def get(self, *args: str) -> dict:
        """`kubectl get ... -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(["helm", *args], env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}\n{self.describe()}")
        return done

    def describe(self) -> str:
        """What the cluster says about its pods and recent events, for failure messages."""
        pods = self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        events = self.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout
        return f"--- pods ---\n{pods}\n--- events ---\n{events[-4000:]}"

    def service_url(self, namespace: str, name: str, port_name: str = "http") -> str:
        """http://CLUSTER_IP:PORT: the host reaches ClusterIPs through kube-proxy's rules, as pods do."""
        svc = self.get("service", name, "-n", namespace)
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == port_name)
        return f"http://{svc['spec']['clusterIP']}:{port}"


def wait_until(what: str, probe, timeout: float = 180, node: Node | None = None, interval: float = 0.5):
    """Poll `probe` until it returns something truthy; fail with its last value (and the cluster's state)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (httpx.HTTPError, subprocess.CalledProcessError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}\n"
                         f"{node.describe() if node else ''}")


_NODE = pytest.StashKey[Node]()


@pytest.fixture(scope="session", name="node")
def node_fixture(request) -> Node:
    """One cluster for the whole session. Each test module that imports this fixture gets its own copy of
    it, so the cluster lives in the config's stash and is stopped when pytest ends."""
    if os.environ.get("MINISGL_K8S_NODE") != "1":
        pytest.skip("the one-node cluster tier runs with MINISGL_K8S_NODE=1 (root; tests/k8s/build-binaries.sh "
                    "and tests/k8s/build-images.sh first)")
    config = request.config
    if _NODE not in config.stash:
        def stop() -> None:
            subprocess.run(["bash", str(K8S / "stop-cluster.sh")], capture_output=True, timeout=300)

        config.add_cleanup(stop)
        started = subprocess.run(["bash", str(K8S / "start-cluster.sh")], capture_output=True, text=True, timeout=600)
        if started.returncode != 0:
            stop()  # (safe twice) so that another module's attempt starts from a clean machine
            pytest.fail(f"start-cluster.sh failed:\n{started.stdout}\n{started.stderr}")
        kubeconfig = started.stdout.strip().splitlines()[-1].removeprefix("KUBECONFIG=")
        config.stash[_NODE] = Node(kubeconfig)
    return config.stash[_NODE]
