"""Bring one MiniSGLModel's children in line with its spec, and its status in line with its pods.

Children are applied server-side with force, owned by the resource (the garbage collector deletes them
with it). A child that anyone but the operator changed or deleted is applied again; objects the spec
no longer renders (a monitor switched off) are deleted. Each model is handled under its own lock, since
events for it and for its children arrive on different worker threads.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field

from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError

from minisgl_operator.kube import Kube, now
from minisgl_operator.render import MODEL_LABEL, RenderError, render
from minisgl_operator.status import Failure, Observed, compute_status

logger = logging.getLogger(__name__)

# Every kind the chart can render for a model: what pruning looks at.
CHILD_KINDS = [("apps/v1", "Deployment"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"),
               ("policy/v1beta1", "PodDisruptionBudget"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
               ("monitoring.coreos.com/v1", "PodMonitor")]


@dataclass
class Applied:
    """What the operator last applied for one model (in memory: a restarted operator applies again)."""
    generation: int
    url: str
    selector: str
    versions: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> resourceVersion


class Reconciler:
    def __init__(self, kube: Kube):
        self.kube = kube
        self._applied: dict[tuple[str, str], Applied] = {}
        self._failed: dict[tuple[str, str], Failure] = {}  # why the latest generation could not be applied
        self._locks: dict[tuple[str, str], threading.Lock] = collections.defaultdict(threading.Lock)
        self._locks_guard = threading.Lock()

    def _lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._locks_guard:
            return self._locks[key]

    def sync(self, namespace: str, name: str, reapply: bool = False) -> None:
        """Apply the children when the spec changed since the last apply (or `reapply`), then refresh the status."""
        key = (namespace, name)
        with self._lock(key):
            model = self.kube.get_model(namespace, name)
            if model is None or model["metadata"].get("deletionTimestamp"):
                return
            applied = self._applied.get(key)
            if reapply or applied is None or applied.generation != model["metadata"]["generation"]:
                failure = self._apply(model)
                if failure:
                    self._failed[key] = failure
                else:
                    self._failed.pop(key, None)
            self._update_status(model)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock((namespace, name)):  # (the lock itself stays: another thread may be holding it)
            self._applied.pop((namespace, name), None)
            self._failed.pop((namespace, name), None)

    def child_event(self, namespace: str, model_name: str, event_type: str | None, child: dict) -> None:
        """A Deployment or Service of a model changed: apply again unless the change was the operator's own."""
        applied = self._applied.get((namespace, model_name))
        ident = (child["kind"], child["metadata"]["name"])
        ours = applied is not None and applied.versions.get(ident) == child["metadata"].get("resourceVersion")
        self.sync(namespace, model_name, reapply=event_type == "DELETED" or not ours)

    def refresh_status(self, namespace: str, name: str) -> None:
        """A pod changed: only the status can be affected."""
        with self._lock((namespace, name)):
            model = self.kube.get_model(namespace, name)
            if model is not None and not model["metadata"].get("deletionTimestamp"):
                self._update_status(model)

    def _apply(self, model: dict) -> Failure | None:
        """Render and apply; returns why not, if the chart refuses the spec or the API refuses an object."""
        meta = model["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            objects = render(meta["name"], meta["namespace"], model.get("spec") or {}, self.kube.version)
        except RenderError as exc:
            return Failure("InvalidSpec", str(exc))
        owner = {"apiVersion": model["apiVersion"], "kind": model["kind"], "name": meta["name"], "uid": meta["uid"],
                 "controller": True, "blockOwnerDeletion": True}
        applied = Applied(meta["generation"], *_endpoints(objects))
        try:
            for obj in objects:
                obj["metadata"]["ownerReferences"] = [owner]
                live = self.kube.apply(obj)
                applied.versions[(obj["kind"], obj["metadata"]["name"])] = live["metadata"]["resourceVersion"]
            self._prune(model, set(applied.versions))
        except (DynamicApiError, ResourceNotFoundError) as exc:
            why = exc.summary() if isinstance(exc, DynamicApiError) else str(exc)
            logger.warning("applying %s/%s failed: %s", *key, why)
            return Failure("ApplyFailed", why)
        if (model.get("status") or {}).get("observedGeneration") != meta["generation"]:
            kinds = ", ".join(f"{kind}/{name}" for kind, name in applied.versions)
            self.kube.event(model, "Normal", "Applied", f"generation {meta['generation']} rendered: {kinds}")
        self._applied[key] = applied
        return None

    def _prune(self, model: dict, keep: set[tuple[str, str]]) -> None:
        meta = model["metadata"]
        for api_version, kind in CHILD_KINDS:
            for obj in self.kube.list(api_version, kind, meta["namespace"], f"{MODEL_LABEL}={meta['name']}"):
                owned = any(ref.get("uid") == meta["uid"] for ref in obj["metadata"].get("ownerReferences") or [])
                if owned and (kind, obj["metadata"]["name"]) not in keep:
                    obj.update(apiVersion=api_version, kind=kind)
                    logger.info("deleting %s/%s: the spec no longer renders it", kind, obj["metadata"]["name"])
                    self.kube.delete(obj)

    def _update_status(self, model: dict) -> None:
        meta, spec = model["metadata"], model.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        applied = self._applied.get((ns, name))
        previous = model.get("status") or {}
        obs = Observed(
            generation=meta["generation"], applied_generation=applied.generation if applied else None,
            desired=spec.get("replicas", 1), deployment=self.kube.get("apps/v1", "Deployment", ns, name),
            pods=self.kube.list("v1", "Pod", ns, f"{MODEL_LABEL}={name}"),
            gpu_resource=spec.get("gpuResourceName", "nvidia.com/gpu"), error=self._failed.get((ns, name)))
        status = compute_status(obs, previous, applied.url if applied else "", applied.selector if applied else "",
                                now())
        if status == previous:
            return
        self.kube.patch_model_status(ns, name, status)
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        old_ready = next((c for c in previous.get("conditions") or [] if c["type"] == "Ready"), {})
        if (status["phase"], ready["reason"]) != (previous.get("phase"), old_ready.get("reason")):
            kind = "Warning" if status["phase"] == "Degraded" else "Normal"
            reason = status["phase"] if status["phase"] in ("Ready", "Stopped") else ready["reason"]
            self.kube.event(model, kind, reason, ready["message"])


def _endpoints(objects: list[dict]) -> tuple[str, str]:
    """The in-cluster API URL (from the rendered Service) and the pod selector (from the Deployment)."""
    url = selector = ""
    for obj in objects:
        if obj["kind"] == "Service":
            port = next(p["port"] for p in obj["spec"]["ports"] if p["name"] == "http")
            url = f"http://{obj['metadata']['name']}.{obj['metadata']['namespace']}.svc:{port}/v1"
        elif obj["kind"] == "Deployment":
            labels = obj["spec"]["selector"]["matchLabels"]
            selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return url, selector
