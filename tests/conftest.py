"""Shared fixtures: tiny random checkpoints of every architecture. Helpers are in helpers.py (imported first:
it chooses Triton's interpreter on the CPU before any kernel module is imported), real servers in
server_fixtures.py."""

from __future__ import annotations

import os

import pytest
from helpers import ARCHS, DEVICE

from minisgl.tools.tiny_model import make_tiny_model

collect_ignore = ["gpu"] if DEVICE == "cpu" else []  # tests/gpu/ is GPU-only: nothing to run here
# The one-node Kubernetes tier changes the machine (root, iptables, containerd): .ci/run runs it apart, with
# MINISGL_K8S_NODE=1, after building its binaries and images.
if os.environ.get("MINISGL_K8S_NODE") != "1":
    collect_ignore.append("k8s/node")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """One tiny fp32 checkpoint per architecture, written by the project's own tiny-model tool."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=0)) for arch in ARCHS}


@pytest.fixture(scope="module")
def client(server):
    """The real `openai` client against the module's `server` fixture (each module that uses it says which)."""
    return server.openai_client()
