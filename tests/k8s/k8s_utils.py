"""Helpers for the deployment tests: render the chart, find objects, read the Dockerfile, wait on a cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm"
OPERATOR_DIR = ROOT / "operator"
if str(OPERATOR_DIR) not in sys.path:
    sys.path.insert(0, str(OPERATOR_DIR))


def helm_template(values: dict | None = None, *files: str, release: str = "minisgl", namespace: str = "default",
                  extra: tuple[str, ...] = ()) -> list[dict]:
    """`helm template` of the chart; raises CalledProcessError (stderr has helm's message) on failure."""
    cmd = ["helm", "template", release, str(CHART), "--namespace", namespace, *extra]
    for f in files:
        cmd += ["-f", str(CHART / f)]
    cmd += ["-f", "-"]
    done = subprocess.run(cmd, input=json.dumps(values or {}), capture_output=True, text=True, check=True)
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def helm_error(values: dict) -> str:
    """helm's error for values the chart must refuse."""
    done = subprocess.run(["helm", "template", "minisgl", str(CHART), "-f", "-"], input=json.dumps(values),
                          capture_output=True, text=True)
    assert done.returncode != 0, f"the chart accepted {values}"
    return done.stderr


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def kinds(objects: list[dict]) -> list[str]:
    return sorted(o["kind"] for o in objects)


def server_container(deployment: dict) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "minisgl")


def dockerfile_entrypoint(path: Path = ROOT / "Dockerfile") -> list[str]:
    """The ENTRYPOINT of the image's final stage (JSON form)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    return json.loads(lines[-1].removeprefix("ENTRYPOINT").strip())


def wait_for(what: str, probe, timeout: float = 90, log=None):
    """Poll `probe` until it returns something truthy; fail with the last value (and a log tail)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    tail = f"\n--- log ---\n{log()[-4000:]}" if log else ""
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}{tail}")
