"""Fixtures for the operator tests: one real control plane and one operator process per session.
(Not a conftest.py: the suite's own conftest module must stay the only `conftest` on sys.path.)

The operator runs as `python -m minisgl_operator` with the token of the chart's operator ServiceAccount,
so the chart's RBAC is what it gets. CRD, ServiceAccount and RBAC come from `helm template` of the chart
with operator.enabled (the operator's own Deployment is replaced by the local process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from control_plane import ADMIN_TOKEN, BIN, ControlPlane, binaries_present, stop_process
from k8s_utils import ROOT, helm_template, wait_for
from kubernetes import client, config, dynamic

OPERATOR_NAMESPACE, OPERATOR_SA = "minisgl-system", "minisgl-operator"
OPERATOR_TOKEN = "operator-token"


@dataclass
class Cluster:
    plane: ControlPlane
    api: client.ApiClient
    dyn: dynamic.DynamicClient
    operator_log: Path

    def log(self) -> str:
        return self.operator_log.read_text(errors="replace")

    def res(self, api_version: str, kind: str):
        return self.dyn.resources.get(api_version=api_version, kind=kind)


@pytest.fixture(scope="session", name="cluster")
def cluster_fixture(tmp_path_factory) -> Cluster:
    if not binaries_present():
        message = f"no kube-apiserver/kube-controller-manager in {BIN} or no etcd: run tests/k8s/build-binaries.sh"
        if os.environ.get("MINISGL_K8S_REQUIRED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    workdir = tmp_path_factory.mktemp("k8s")
    plane = ControlPlane(workdir, {OPERATOR_TOKEN: f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"})
    proc = None
    try:
        plane.start_apiserver()
        api = config.new_client_from_config(str(plane.kubeconfig(ADMIN_TOKEN)))
        dyn = dynamic.DynamicClient(api)
        client.CoreV1Api(api).create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}})
        install = helm_template({"operator": {"enabled": True}}, namespace=OPERATOR_NAMESPACE)
        for obj in install:
            if obj["kind"] != "Deployment":
                dyn.create(dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"]), body=obj,
                           namespace=obj["metadata"].get("namespace", OPERATOR_NAMESPACE))
        crds = dyn.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
        wait_for("the MiniSGLModel CRD", lambda: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in crds.get(name="minisglmodels.minisgl.io").status.conditions or []))
        plane.start_controllers()  # after the CRD: the garbage collector then knows the kind at once

        operator_log = workdir / "operator.log"
        env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig(OPERATOR_TOKEN)),
               "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}", "MINISGL_CHART": str(ROOT / "helm"),
               "PYTHONWARNINGS": "ignore:Unverified HTTPS request"}  # the test apiserver's self-signed cert
        with open(operator_log, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "minisgl_operator", "--all-namespaces"], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        yield Cluster(plane, api, dyn, operator_log)
    finally:
        if proc is not None:
            stop_process(proc, timeout=20)
        plane.stop()


@pytest.fixture(name="namespace")
def namespace_fixture(cluster: Cluster) -> str:
    """A fresh namespace per test, so tests never see each other's objects."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(cluster.api).create_namespace({"metadata": {"name": name}})
    return name
