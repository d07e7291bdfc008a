#!/usr/bin/env bash
# Stop what start-cluster.sh started and put the machine back: every process by its saved PID (node first,
# etcd last), the pods' containers, shims and network namespaces, mounts, cgroups, iptables rules and chains,
# the bridge and route, and the kernel settings. Logs stay in $MINISGL_K8S_RUN/logs, imported images in
# containerd's root (a cache). Safe to run twice.
set -uo pipefail
BIN=${MINISGL_K8S_BIN:-$HOME/.cache/minisgl-k8s/bin}
R=${MINISGL_K8S_RUN:-${TMPDIR:-/tmp}/minisgl-k8s}
SOCK=/run/minisgl-k8s/containerd.sock
stop() { # stop <name> [timeout_s]: SIGTERM, then SIGKILL
  [ -f "$R/pids/$1" ] || return 0
  local pid; pid=$(cat "$R/pids/$1"); kill "$pid" 2>/dev/null
  for _ in $(seq 1 $(( ${2:-5} * 10 ))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null; rm -f "$R/pids/$1"; }

stop proxy; stop kubelet; stop scheduler; stop svc-dns; stop dnsmasq
if [ -f "$R/pids/containerd" ] && ctr -a $SOCK version >/dev/null 2>&1; then
  # No kubelet now, so no CRI teardown: note each sandbox's network namespace, then kill and delete.
  netns=$(for c in $(ctr -a $SOCK -n k8s.io containers ls -q); do ctr -a $SOCK -n k8s.io containers info "$c" \
    | jq -r '.Spec.linux.namespaces[]? | select(.type == "network" and .path != null) | .path'; done | sort -u)
  for c in $(ctr -a $SOCK -n k8s.io tasks ls -q); do ctr -a $SOCK -n k8s.io tasks kill -s SIGKILL "$c" >/dev/null 2>&1; done
  sleep 1
  for c in $(ctr -a $SOCK -n k8s.io tasks ls -q); do ctr -a $SOCK -n k8s.io tasks delete -f "$c" >/dev/null 2>&1; done
  for c in $(ctr -a $SOCK -n k8s.io containers ls -q); do ctr -a $SOCK -n k8s.io containers delete "$c" >/dev/null 2>&1; done
  for ns in $netns; do umount "$ns" 2>/dev/null; rm -f "$ns"; done
fi
stop containerd 10
# Shims of this containerd (they carry its socket in their command line) that outlived their task.
for p in /proc/[0-9]*; do
  case "$(cat "$p/comm" 2>/dev/null)" in containerd-shim*) ;; *) continue ;; esac
  tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -qF -- "-address $SOCK" && kill -9 "${p#/proc/}" 2>/dev/null
done
stop controller-manager; stop apiserver 10; stop etcd 10

CROOT=${MINISGL_K8S_CONTAINERD:-$HOME/.cache/minisgl-k8s/containerd}
awk '{print $2}' /proc/mounts | grep -E "^($R|$CROOT|/run/minisgl-k8s)/" | sort -r \
  | while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
for d in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do   # kubelet's pod cgroups, deepest first
  [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
done
[ -x "$BIN/kube-proxy" ] && "$BIN/kube-proxy" --cleanup >/dev/null 2>&1
for t in filter nat mangle; do   # kubelet's chains (KUBE-FIREWALL, KUBE-MARK-*, canaries) and any left over
  iptables -t $t -S | grep -E '^-A [A-Z]+ .*-j KUBE-' | grep -vE '^-A KUBE-' | sed 's/^-A/-D/' \
    | while read -r rule; do eval "iptables -t $t $rule"; done
  for c in $(iptables -t $t -S | awk '/^-N KUBE-/{print $2}'); do iptables -t $t -F "$c"; done
  for c in $(iptables -t $t -S | awk '/^-N KUBE-/{print $2}'); do iptables -t $t -X "$c"; done
done 2>/dev/null
iptables -D FORWARD -i k8sbr0 ! -o k8sbr0 -j REJECT 2>/dev/null
ip route del 10.96.0.0/16 dev k8sbr0 2>/dev/null
ip link del k8sbr0 2>/dev/null
if [ -f "$R/sysctl.saved" ]; then
  while read -r k v; do echo "$v" > "/proc/sys/$k"; done < "$R/sysctl.saved"; rm -f "$R/sysctl.saved"
fi
rm -rf "$R/kubelet" "$R/etcd" /run/minisgl-k8s   # (containerd's root, with the imported images, is a cache)
echo "cluster stopped"
