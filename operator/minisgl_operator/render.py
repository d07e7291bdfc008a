"""MiniSGLModel spec -> Kubernetes objects, by rendering the Helm chart.

The chart is the only description of the server pod: a MiniSGLModel's spec fields are chart values
(the CRD's spec schema is cut from the chart's values.schema.json), so the operator passes the spec
through, fixes the names and labels that tie the objects to the resource, and runs `helm template`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
from pathlib import Path

import yaml

GROUP, VERSION, PLURAL, KIND = "minisgl.io", "v1alpha1", "minisglmodels", "MiniSGLModel"
MODEL_LABEL = "minisgl.io/model"  # on every child and pod: which MiniSGLModel it belongs to
MANAGER = "minisgl-operator"  # field manager, event source and managed-by label

DEFAULT_CHART = Path(__file__).resolve().parents[2] / "helm"  # the repository layout, kept in the image


class RenderError(Exception):
    """The spec passed the CRD schema but the chart refused it (its message says why)."""


def chart_path() -> Path:
    return Path(os.environ.get("MINISGL_CHART", DEFAULT_CHART))


def chart_values(name: str, spec: dict) -> dict:
    """Chart values for one resource: its spec, plus the names and labels that bind the children to it.
    Release-only extras (helm test pod, autoscaler, dashboard, operator) stay off: an HPA targets the
    MiniSGLModel itself through /scale."""
    values = copy.deepcopy(spec)
    values.update(fullnameOverride=name, commonLabels={MODEL_LABEL: name}, tests={"enabled": False},
                  autoscaling={"enabled": False}, grafanaDashboard={"enabled": False}, operator={"enabled": False})
    return values


def render(name: str, namespace: str, spec: dict, kube_version: str) -> list[dict]:
    """The objects the chart renders for this resource, labelled as the operator's."""
    objects = _helm_template(name, namespace, json.dumps(chart_values(name, spec), sort_keys=True), kube_version,
                             str(chart_path()))
    objects = copy.deepcopy(objects)  # callers add owner references; the cache must stay clean
    for obj in objects:
        obj["metadata"].setdefault("labels", {})["app.kubernetes.io/managed-by"] = MANAGER
        obj["metadata"]["namespace"] = namespace
    return objects


@functools.lru_cache(maxsize=256)
def _helm_template(name: str, namespace: str, values_json: str, kube_version: str, chart: str) -> list[dict]:
    cmd = ["helm", "template", name, chart, "--namespace", namespace, "--kube-version", kube_version, "-f", "-"]
    done = subprocess.run(cmd, input=values_json, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RenderError(_helm_error(done.stderr))
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def _helm_error(stderr: str) -> str:
    """helm's message without its noise (symlink notices, the --debug hint)."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "symbolic link" not in ln and "--debug" not in ln]
    return " ".join(ln.strip() for ln in lines).removeprefix("Error: ")
