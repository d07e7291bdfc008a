"""The few Kubernetes API calls the operator makes, over the official client's dynamic API."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from datetime import datetime, timezone

from kubernetes import client, config, dynamic
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from minisgl_operator.render import GROUP, KIND, MANAGER, VERSION

logger = logging.getLogger(__name__)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class Kube:
    def __init__(self):
        self.api = client.ApiClient()
        self.dyn = dynamic.DynamicClient(self.api)
        self._lock = threading.Lock()  # the dynamic client's discovery cache is not thread-safe
        info = client.VersionApi(self.api).get_code()
        self.version = info.git_version.lstrip("v").split("-")[0].split("+")[0]

    def resource(self, api_version: str, kind: str):
        """The API resource for a kind, or None when the cluster does not serve it (e.g. no Prometheus Operator)."""
        with self._lock:
            try:
                return self.dyn.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError:
                return None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self.dyn.get(self.resource(api_version, kind), name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def get_model(self, namespace: str, name: str) -> dict | None:
        return self.get(f"{GROUP}/{VERSION}", KIND, namespace, name)

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict]:
        res = self.resource(api_version, kind)
        if res is None:
            return []
        return self.dyn.get(res, namespace=namespace, label_selector=selector).to_dict()["items"]

    def apply(self, obj: dict) -> dict:
        """Server-side apply as the operator, taking back fields someone else changed (force)."""
        res = self.resource(obj["apiVersion"], obj["kind"])
        if res is None:
            raise ResourceNotFoundError(f"the cluster does not serve {obj['kind']} ({obj['apiVersion']})")
        return self.dyn.server_side_apply(res, body=obj, namespace=obj["metadata"]["namespace"],
                                          field_manager=MANAGER, force_conflicts=True).to_dict()

    def delete(self, obj: dict) -> None:
        try:
            self.dyn.delete(self.resource(obj["apiVersion"], obj["kind"]), name=obj["metadata"]["name"],
                            namespace=obj["metadata"]["namespace"])
        except NotFoundError:
            pass

    def patch_model_status(self, namespace: str, name: str, status: dict) -> None:
        res = self.resource(f"{GROUP}/{VERSION}", KIND).status
        try:
            self.dyn.patch(res, body={"status": status}, name=name, namespace=namespace,
                           content_type="application/merge-patch+json")
        except NotFoundError:  # deleted since it was read: nothing left to report on
            pass

    def event(self, model: dict, kind: str, reason: str, message: str) -> None:
        """A core/v1 Event on the MiniSGLModel (what `kubectl describe` shows)."""
        meta, stamp = model["metadata"], now()
        body = {
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": model["apiVersion"], "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": kind, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": MANAGER}, "reportingComponent": MANAGER, "reportingInstance": socket.gethostname(),
        }
        try:
            client.CoreV1Api(self.api).create_namespaced_event(meta["namespace"], body)
        except client.ApiException as exc:  # events are best effort: never fail a reconcile for one
            logger.warning("could not record event %s on %s: %s", reason, meta["name"], exc.reason)
