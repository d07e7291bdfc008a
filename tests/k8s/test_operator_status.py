"""The status rules on pod and Deployment states the API-server tests do not write: image pulls, plain
crash loops, evictions, stalled rollouts, scale to zero, and condition timestamps."""

from __future__ import annotations

import k8s_utils  # noqa: F401  (puts operator/ on sys.path)
import pytest
from minisgl_operator.status import Failure, Observed, compute_status, pod_failure

GPU = "nvidia.com/gpu"


def pod(name: str = "p", **status) -> dict:
    return {"metadata": {"name": name}, "status": status}


def container(**fields) -> dict:
    return {"name": "minisgl", "restartCount": fields.pop("restarts", 0), **fields}


@pytest.mark.parametrize("status,reason", [
    ({"containerStatuses": [container(state={"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})]},
     "ImagePullBackOff"),
    ({"containerStatuses": [container(state={"waiting": {"reason": "ErrImagePull"}})]}, "ErrImagePull"),
    ({"containerStatuses": [container(restarts=3, state={"waiting": {"reason": "CrashLoopBackOff"}},
                                      lastState={"terminated": {"reason": "Error", "exitCode": 1}})]},
     "CrashLoopBackOff"),
    ({"containerStatuses": [container(state={"terminated": {"reason": "OOMKilled", "exitCode": 137}})]}, "OOMKilled"),
    ({"initContainerStatuses": [container(state={"waiting": {"reason": "CreateContainerConfigError",
                                                             "message": 'secret "hf" not found'}})]},
     "CreateContainerConfigError"),
    ({"phase": "Failed", "reason": "Evicted", "message": "low on memory"}, "Evicted"),
    ({"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/2 nodes are available: 2 node(s) didn't match node selector."}]}, "Unschedulable"),
    ({"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}]}, "InsufficientGPU"),
])
def test_pod_failures_are_named(status, reason):
    assert pod_failure(pod(**status), GPU).reason == reason


def test_a_crash_loop_names_the_servers_last_log_line():
    """With FallbackToLogsOnError the termination message is the log's end: its last line says why."""
    log = "Traceback (most recent call last):\n  ...\nModelLoadError: model '/models/nope' is not a local directory\n"
    crash = container(restarts=2, state={"waiting": {"reason": "CrashLoopBackOff"}},
                      lastState={"terminated": {"reason": "Error", "exitCode": 1, "message": log}})
    message = pod_failure(pod(containerStatuses=[crash]), GPU).message
    assert message.endswith("last exit: Error (1). Its last log line: ModelLoadError: model '/models/nope' is not a "
                            "local directory"), message


@pytest.mark.parametrize("status", [
    {},  # just created, nothing scheduled it yet
    {"phase": "Pending", "containerStatuses": [container(state={"waiting": {"reason": "ContainerCreating"}})]},
    {"phase": "Running", "containerStatuses": [container(ready=False, state={"running": {}})]},  # loading
])
def test_progress_is_not_a_failure(status):
    assert pod_failure(pod(**status), GPU) is None


def deployment(replicas: int, ready: int, updated: int | None = None, conditions=()) -> dict:
    updated = replicas if updated is None else updated
    return {"metadata": {"generation": 3}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": 3, "replicas": replicas, "updatedReplicas": updated,
                       "readyReplicas": ready, "conditions": list(conditions)}}


def ready_pod(name: str) -> dict:
    return pod(name, phase="Running", containerStatuses=[container(ready=True, state={"running": {}})])


def status(obs: Observed, previous: dict | None = None, now: str = "T1") -> dict:
    return compute_status(obs, previous or {}, "http://m.ns.svc:1919/v1", "a=b", now)


def test_ready_needs_the_current_spec_applied_and_every_pod_on_it():
    pods = [ready_pod("a"), ready_pod("b")]
    assert status(Observed(5, 5, 2, deployment(2, 2), pods))["phase"] == "Ready"
    # the resource changed since the children were rendered
    assert status(Observed(6, 5, 2, deployment(2, 2), pods))["phase"] == "Progressing"
    # an old pod is still there next to the new ones
    rolling = status(Observed(5, 5, 2, deployment(3, 2, updated=2), pods + [ready_pod("old")]))
    assert rolling["phase"] == "Progressing" and rolling["conditions"][1]["reason"] == "RollingOut"


def test_stalled_rollout_and_scale_to_zero():
    stalled = deployment(1, 0, conditions=[{"type": "Progressing", "status": "False",
                                            "reason": "ProgressDeadlineExceeded", "message": "too slow"}])
    s = status(Observed(1, 1, 1, stalled, [pod("a", phase="Running")]))
    assert s["phase"] == "Degraded" and s["lastFailure"] == {"reason": "ProgressDeadlineExceeded",
                                                             "message": "too slow", "time": "T1"}
    stopped = status(Observed(1, 1, 0, deployment(0, 0), []))
    assert stopped["phase"] == "Stopped" and stopped["conditions"][0]["reason"] == "ScaledToZero"


def test_condition_times_move_only_on_transitions_and_last_failure_is_kept():
    obs_ok = Observed(1, 1, 1, deployment(1, 1), [ready_pod("a")])
    first = status(obs_ok, now="T1")
    again = status(obs_ok, first, now="T2")
    assert again == first  # nothing changed: nothing to write
    crash = pod("a", containerStatuses=[container(state={"waiting": {"reason": "CrashLoopBackOff"}})])
    broken = status(Observed(1, 1, 1, deployment(1, 0), [crash]), again, now="T3")
    ready = {c["type"]: c for c in broken["conditions"]}
    assert ready["Ready"]["lastTransitionTime"] == "T3" and ready["Degraded"]["lastTransitionTime"] == "T3"
    assert broken["lastFailure"] == {"reason": "CrashLoopBackOff", "pod": "a", "time": "T3",
                                     "message": "container minisgl: CrashLoopBackOff after 0 restart(s)."}
    healed = status(obs_ok, broken, now="T4")
    assert healed["phase"] == "Ready" and healed["lastFailure"] == broken["lastFailure"]


def test_render_or_apply_error_comes_first():
    s = status(Observed(2, 1, 1, deployment(1, 1), [ready_pod("a")], error=Failure("InvalidSpec", "bad")))
    assert s["phase"] == "Degraded" and s["observedGeneration"] == 1
    assert s["conditions"][2] == {"type": "Degraded", "status": "True", "reason": "InvalidSpec", "message": "bad",
                                  "lastTransitionTime": "T1", "observedGeneration": 2}
