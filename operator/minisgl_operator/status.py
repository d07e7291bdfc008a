"""A MiniSGLModel's status, computed from what the cluster says about its Deployment and pods.

Pure functions over API objects (dicts), so the rules are easy to read: Ready only when the resource's
current spec is applied and every pod runs it and passes readiness; a pod that cannot be scheduled,
cannot pull its image, crash-loops or is OOM-killed makes the resource Degraded, whatever the counts say.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Waiting reasons of a container that will not fix themselves.
STUCK_WAITING = {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                 "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str
    pod: str = ""


def pod_failure(pod: dict, gpu_resource: str) -> Failure | None:
    """Why this pod cannot serve, if the reason is a failure rather than progress (loading, pulling)."""
    name, status = pod["metadata"]["name"], pod.get("status") or {}
    if status.get("phase") == "Failed":
        return Failure(status.get("reason") or "PodFailed", status.get("message") or "the pod failed", name)
    for cond in status.get("conditions") or []:
        if cond["type"] == "PodScheduled" and cond["status"] == "False" and cond.get("reason") == "Unschedulable":
            message = cond.get("message") or "no node fits the pod"
            reason = "InsufficientGPU" if f"Insufficient {gpu_resource}" in message else "Unschedulable"
            return Failure(reason, message, name)
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        failure = _container_failure(cs)
        if failure:
            return Failure(failure[0], failure[1], name)
    return None


def _container_failure(cs: dict) -> tuple[str, str] | None:
    state, last = cs.get("state") or {}, (cs.get("lastState") or {}).get("terminated") or {}
    restarts = cs.get("restartCount", 0)
    waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
    if waiting.get("reason") in STUCK_WAITING:
        reason = waiting["reason"]
        if reason == "CrashLoopBackOff" and last.get("reason") == "OOMKilled":
            reason = "OOMKilled"
        detail = waiting.get("message") or (f"last exit: {last.get('reason')} ({last.get('exitCode')})" if last else "")
        said = _last_line(last.get("message"))
        detail = f"{detail}. Its last log line: {said}" if said else detail
        return reason, f"container {cs['name']}: {reason} after {restarts} restart(s). {detail}".strip()
    if terminated.get("reason") == "OOMKilled":
        return "OOMKilled", f"container {cs['name']} was OOM-killed (exit {terminated.get('exitCode')})"
    return None


def _last_line(message: str | None) -> str:
    """The last line of a termination message: with FallbackToLogsOnError, the end of the log, where a
    server that could not start says why (a traceback's final line names the exception)."""
    lines = [ln.strip() for ln in (message or "").splitlines() if ln.strip()]
    return lines[-1][:500] if lines else ""


def deployment_failure(deployment: dict) -> Failure | None:
    """Failures the Deployment controller reports itself: pods it cannot create, a stalled rollout."""
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond["type"] == "ReplicaFailure" and cond["status"] == "True":
            return Failure(cond.get("reason") or "ReplicaFailure", cond.get("message") or "")
        if cond["type"] == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Failure("ProgressDeadlineExceeded", cond.get("message") or "")
    return None


@dataclass(frozen=True)
class Observed:
    """What the operator knows about one resource when it computes the status."""
    generation: int  # of the MiniSGLModel
    applied_generation: int | None  # the generation its children were last rendered from (None: never)
    desired: int  # spec.replicas
    deployment: dict | None
    pods: list[dict]
    gpu_resource: str = "nvidia.com/gpu"
    error: Failure | None = None  # the spec could not be rendered or applied


def compute_status(obs: Observed, previous: dict, url: str, selector: str, now: str) -> dict:
    """The full status object. Conditions keep their lastTransitionTime unless their status flips; the
    last failure is kept after it clears (the conditions say what holds now)."""
    dep = obs.deployment
    dstat = (dep or {}).get("status") or {}
    replicas, updated, ready = (dstat.get(k, 0) for k in ("replicas", "updatedReplicas", "readyReplicas"))

    failure = obs.error
    for pod in sorted(obs.pods, key=lambda p: p["metadata"]["name"]):
        failure = failure or pod_failure(pod, obs.gpu_resource)
    failure = failure or (deployment_failure(dep) if dep else None)

    applied = obs.applied_generation == obs.generation and dep is not None
    synced = applied and dstat.get("observedGeneration", 0) >= dep["metadata"].get("generation", 0)
    rolled_out = synced and dep["spec"].get("replicas") == obs.desired and \
        replicas == updated == ready == obs.desired and len(obs.pods) == obs.desired
    is_ready = rolled_out and failure is None

    if is_ready:
        phase = "Stopped" if obs.desired == 0 else "Ready"
        why = ("ScaledToZero", "no replicas requested") if obs.desired == 0 else \
            ("AllReplicasReady", f"{ready}/{obs.desired} pods ready on generation {obs.generation}")
    elif failure:
        phase, why = "Degraded", (failure.reason, failure.message)
    else:
        phase, why = "Progressing", _progress(obs, applied, replicas, updated, ready)

    conditions = [
        _condition(previous, "Ready", is_ready, why, now, obs.generation),
        _condition(previous, "Progressing", phase == "Progressing", why, now, obs.generation),
        _condition(previous, "Degraded", failure is not None,
                   (failure.reason, failure.message) if failure else ("NoFailure", "no pod reports a failure"),
                   now, obs.generation),
    ]
    status = {
        "observedGeneration": obs.applied_generation if obs.applied_generation is not None else 0,
        "replicas": replicas, "updatedReplicas": updated, "readyReplicas": ready, "phase": phase,
        "conditions": conditions,
    }
    status.update({k: v for k, v in (("url", url), ("selector", selector)) if v})  # unknown before a render
    last = previous.get("lastFailure")
    if failure:
        same = last and (last.get("reason"), last.get("pod", "")) == (failure.reason, failure.pod)
        last = last if same else {k: v for k, v in {**asdict(failure), "time": now}.items() if v}
    if last:
        status["lastFailure"] = last
    return status


def _progress(obs: Observed, applied: bool, replicas: int, updated: int, ready: int) -> tuple[str, str]:
    if not applied:
        return "Applying", f"rendering generation {obs.generation}"
    if updated < obs.desired or replicas > obs.desired:
        return "RollingOut", f"{updated}/{obs.desired} pods on the current spec, {replicas} in all"
    return "Loading", f"{ready}/{obs.desired} pods ready (loading the model)"


def _condition(previous: dict, kind: str, value: bool, why: tuple[str, str], now: str, generation: int) -> dict:
    status = "True" if value else "False"
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == kind), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") \
        else now
    return {"type": kind, "status": status, "reason": why[0], "message": why[1], "lastTransitionTime": since,
            "observedGeneration": generation}
