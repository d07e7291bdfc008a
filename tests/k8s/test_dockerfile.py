"""The images' Dockerfiles: hadolint-clean, and agreeing with what the chart assumes about them (user, port,
entrypoint, cache volume); the operator's generated install manifest matches the chart."""

from __future__ import annotations

import re
import subprocess

import pytest
from k8s_utils import CHART, ROOT, dockerfile_entrypoint, find, helm_template, server_container
from minisgl_operator import render


@pytest.mark.parametrize("path", ["Dockerfile", "operator/Dockerfile"])
def test_hadolint_clean(path):
    done = subprocess.run(["hadolint", "--no-color", str(ROOT / path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def instructions(path: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / path).read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_server_image_matches_the_chart():
    ins = instructions("Dockerfile")
    froms = [a for i, a in ins if i == "FROM"]
    assert froms == ["${BASE} AS build", "${BASE} AS runtime"]  # multi-stage, one base chosen by a build arg
    base = next(a for i, a in ins if i == "ARG" and a.startswith("BASE="))
    assert re.fullmatch(r"BASE=nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base)  # pinned, not :latest

    runtime = ins[ins.index(("FROM", "${BASE} AS runtime")):]
    user = [a for i, a in runtime if i == "USER"][-1]
    dep = find(helm_template({"model": "a/b"}), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    assert [a for i, a in runtime if i == "EXPOSE"] == [str(pod["containers"][0]["ports"][0]["containerPort"])]
    assert dockerfile_entrypoint() == ["python", "-m", "minisgl"]

    cache = next(m["mountPath"] for m in server_container(dep)["volumeMounts"] if m["name"] == "cache")
    assert [a for i, a in runtime if i == "VOLUME"] == [f'["{cache}"]']
    env = " ".join(a for i, a in runtime if i == "ENV")
    assert f"HF_HOME={cache}/huggingface" in env and "HOME=/home/minisgl" in env


def test_operator_image_keeps_the_repository_layout():
    ins = instructions("operator/Dockerfile")
    copies = [a for i, a in ins if i == "COPY"]
    assert "helm /opt/minisgl/helm" in copies and "operator/minisgl_operator /opt/minisgl/operator/minisgl_operator" \
        in copies
    # the operator looks for the chart two levels above its package, as in the repository
    assert render.DEFAULT_CHART == ROOT / "helm"
    assert [a for i, a in ins if i == "USER"] == ["10001:10001"]


def test_generated_operator_manifest_matches_the_chart():
    shipped = (ROOT / "operator/deploy/operator.yaml").read_text()
    done = subprocess.run(["helm", "template", "minisgl", str(CHART), "--namespace", "minisgl-system",
                           "--set", "operator.enabled=true"], capture_output=True, text=True, check=True)
    body = shipped.split("\n---\n", 1)[1]
    assert "---\n" + body == done.stdout, "operator/deploy/operator.yaml is stale: run operator/deploy/generate.sh"
