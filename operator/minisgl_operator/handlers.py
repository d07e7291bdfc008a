"""kopf wiring: which watch events lead to which reconcile step. No handler keeps kopf state on the
resources (no finalizers, no annotations): the operator is stateless and recomputes from the cluster."""

from __future__ import annotations

import logging

import kopf

from minisgl_operator.kube import Kube, load_config
from minisgl_operator.reconcile import Reconciler
from minisgl_operator.render import GROUP, MODEL_LABEL, PLURAL, VERSION

OWNED = {MODEL_LABEL: kopf.PRESENT}


@kopf.on.startup()
def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's would repeat it
    load_config()
    memo.reconciler = Reconciler(Kube())


@kopf.on.event(GROUP, VERSION, PLURAL)
def model_changed(type: str | None, name: str, namespace: str, memo: kopf.Memo, **_) -> None:
    if type == "DELETED":  # the garbage collector removes the children
        memo.reconciler.forget(namespace, name)
    else:
        memo.reconciler.sync(namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
@kopf.on.event("", "v1", "services", labels=OWNED)
def child_changed(type: str | None, body: kopf.Body, namespace: str, labels: kopf.Labels, memo: kopf.Memo,
                  **_) -> None:
    memo.reconciler.child_event(namespace, labels[MODEL_LABEL], type, dict(body))


@kopf.on.event("", "v1", "pods", labels=OWNED)
def pod_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_) -> None:
    memo.reconciler.refresh_status(namespace, labels[MODEL_LABEL])
