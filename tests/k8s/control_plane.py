"""A real Kubernetes control plane on 127.0.0.1 for the operator tests: etcd, kube-apiserver and
kube-controller-manager (ReplicaSets, pods, garbage collection). No scheduler and no kubelet: pods stay
Pending unless a test writes their status. Binaries: tests/k8s/build-binaries.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from minisgl.distributed import free_port

BIN = Path(os.environ.get("MINISGL_K8S_BIN", Path.home() / ".cache/minisgl-k8s/bin"))
ADMIN_TOKEN = "admin-token"


def binaries_present() -> bool:
    return all((BIN / b).exists() for b in ("kube-apiserver", "kube-controller-manager")) and \
        shutil.which("etcd") is not None


class ControlPlane:
    def __init__(self, workdir: Path, users: dict[str, str]):
        """users: extra static tokens, token -> user name (e.g. a service account's name, for RBAC tests)."""
        self.dir = workdir
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        (workdir / "certs").mkdir(parents=True)
        subprocess.run(["openssl", "genrsa", "-out", str(workdir / "certs/sa.key"), "2048"], check=True,
                       capture_output=True)
        lines = [f"{ADMIN_TOKEN},admin,admin,system:masters"]
        lines += [f"{token},{user},{user}" for token, user in users.items()]
        (workdir / "tokens.csv").write_text("\n".join(lines) + "\n")

    def start_apiserver(self) -> None:
        etcd_port, peer_port = free_port(), free_port()
        etcd = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", ["etcd", "--data-dir", str(self.dir / "etcd"), "--listen-client-urls", etcd,
                             "--advertise-client-urls", etcd, "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                             "--unsafe-no-fsync=true"])
        self._spawn("apiserver", [
            str(BIN / "kube-apiserver"), f"--etcd-servers={etcd}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={self.port}", "--insecure-port=0",
            f"--cert-dir={self.dir / 'certs'}", f"--token-auth-file={self.dir / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.dir / 'certs/sa.key'}",
            f"--service-account-signing-key-file={self.dir / 'certs/sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16", "--disable-admission-plugins=ServiceAccount"])
        self._wait("apiserver", lambda: httpx.get(f"{self.url}/readyz", verify=False, timeout=2,
                                                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text == "ok")

    def start_controllers(self) -> None:
        """Start after the CRDs exist: the garbage collector re-reads the API groups only every ~30 s."""
        kubeconfig = str(self.kubeconfig(ADMIN_TOKEN))
        self._spawn("controller-manager", [
            str(BIN / "kube-controller-manager"), f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", "--port=0", f"--secure-port={free_port()}", "--leader-elect=false",
            f"--service-account-private-key-file={self.dir / 'certs/sa.key'}",
            f"--root-ca-file={self.dir / 'certs/apiserver.crt'}", "--use-service-account-credentials=false",
            "--controllers=deployment,replicaset,garbagecollector"])

    def kubeconfig(self, token: str) -> Path:
        path = self.dir / f"kubeconfig-{token}"
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: local, cluster: {{server: '{self.url}', insecure-skip-tls-verify: true}}}}]\n"
            f"users: [{{name: user, user: {{token: {token}}}}}]\n"
            "contexts: [{name: local, context: {cluster: local, user: user, namespace: default}}]\n"
            "current-context: local\n")
        return path

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait(self, name: str, ready, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited:\n{self.log(name)[-3000:]}")
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{name} not ready after {timeout}s:\n{self.log(name)[-3000:]}")

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        """Controllers and apiserver before etcd: an apiserver whose etcd is gone can hang in shutdown."""
        for name in ("controller-manager", "apiserver", "etcd"):
            if name in self.procs:
                stop_process(self.procs[name])


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
