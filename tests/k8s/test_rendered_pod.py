"""The rendered pod really starts a server: the image's ENTRYPOINT (from the Dockerfile) plus the container
args and env of the Deployment that the chart, or the operator, renders run as a local process with the
demo model (on the CPU; with device: cuda when MINISGL_TEST_DEVICE=cuda). The manifest's own probe paths
and port answer, the OpenAI API works, the `helm test` script passes against it, and SIGTERM drains within
the pod's grace period."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers import DEVICE
from k8s_utils import ROOT, dockerfile_entrypoint, find, helm_template, server_container
from minisgl_operator.render import render
from openai import OpenAI

from minisgl.distributed import free_port


def rendered(source: str, port: int, extra: dict) -> tuple[dict, list[dict]]:
    """The Deployment (and all objects) for a demo server on the test device, listening on `port`."""
    values = {"demo": True, "device": DEVICE, "port": port, **extra}
    if source == "chart":
        objects = helm_template(values)
    else:
        objects = render("tiny", "default", {"model": "demo", **values}, "1.30.0")
    return find(objects, "Deployment"), objects


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of container args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


class Pod:
    """A container of a rendered Deployment, run as a local process (secrets given as plain values)."""

    def __init__(self, deployment: dict, secrets: dict[str, str], log_path):
        self.container = server_container(deployment)
        self.grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for var in self.container.get("env", []):
            env[var["name"]] = var["value"] if "value" in var else secrets[var["name"]]
        entrypoint = dockerfile_entrypoint()
        assert entrypoint[0] == "python"
        cmd = [sys.executable, *entrypoint[1:], *(expand(a, env) for a in self.container["args"])]
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def port(self, name_or_number) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name_or_number)

    def get(self, probe: dict) -> int:
        url = f"http://127.0.0.1:{self.port(probe['httpGet']['port'])}{probe['httpGet']['path']}"
        return httpx.get(url, timeout=probe.get("timeoutSeconds", 1)).status_code

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def wait_started(self) -> None:
        """What the kubelet does with the startupProbe: poll it until 200, within the manifest's budget."""
        probe = self.container["startupProbe"]
        deadline = time.monotonic() + probe["periodSeconds"] * probe["failureThreshold"]
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited:\n{self.output()}"
            try:
                if self.get(probe) == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"startup probe never passed:\n{self.output()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.wait()


@pytest.mark.parametrize("source", ["chart", "operator"])
def test_rendered_pod_serves_and_passes_its_probes(source, tmp_path):
    """With an API key from a Secret, which reaches the server through $(MINISGL_API_KEY). For the chart, the
    `helm test` pod's script runs too, with its own env (the Service URL pointed at the local port)."""
    port = free_port()
    deployment, objects = rendered(source, port, {"apiKeySecret": {"name": "keys"}})
    pod = Pod(deployment, {"MINISGL_API_KEY": "s3cret"}, tmp_path / "server.log")
    try:
        pod.wait_started()
        container = pod.container
        assert pod.get(container["readinessProbe"]) == 200
        live = container["livenessProbe"]["tcpSocket"]
        socket.create_connection(("127.0.0.1", pod.port(live["port"])), timeout=5).close()

        served = container["args"][container["args"].index("--served-model-name") + 1]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret")
        assert [m.id for m in client.models.list().data] == [served]
        out = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=5, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
        if source == "chart":
            run_helm_test_pod(find(objects, "Pod"), port)
    finally:
        code = pod.stop()
    assert code == 0, pod.output()[-3000:]


def run_helm_test_pod(test_pod: dict, port: int) -> None:
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (client,) = test_pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in client["env"]}
    assert env["MINISGL_URL"] == "http://minisgl.default.svc:1919/v1"  # the Service's port
    assert client["command"] == ["python", "-c"]

    def run(key: str) -> subprocess.CompletedProcess:
        local = {**env, "MINISGL_URL": f"http://127.0.0.1:{port}/v1", "MINISGL_API_KEY": key}
        return subprocess.run([sys.executable, "-c", *client["args"]], env={**os.environ, **local},
                              capture_output=True, text=True, timeout=120)

    done = run("s3cret")
    assert done.returncode == 0 and "completion:" in done.stdout, done.stdout + done.stderr
    done = run("wrong")
    assert done.returncode != 0 and "401" in done.stderr
