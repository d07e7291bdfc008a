#!/usr/bin/env bash
# Debian packages the one-node cluster and the local image builds need (apt only; run as root):
# containerd 1.6 + runc, the CNI plugins, iptables/conntrack (kube-proxy), dnsmasq (cluster DNS),
# buildah + mmdebstrap (images without a registry), gcc + busybox-static (the pause image).
# Skips apt when every command is already there.
set -euo pipefail
need=(containerd runc /usr/lib/cni/bridge iptables conntrack dnsmasq jq buildah mmdebstrap gcc busybox etcd)
missing=0
for c in "${need[@]}"; do command -v "$c" >/dev/null || [ -x "$c" ] || missing=1; done
[ -f /usr/include/stdio.h ] || missing=1
if [ $missing = 1 ]; then
  apt-get update -q
  apt-get install -y -q --no-install-recommends containerd runc containernetworking-plugins iptables conntrack \
    dnsmasq-base jq buildah mmdebstrap gcc libc6-dev busybox-static etcd-server uidmap fuse-overlayfs
fi
echo "node packages: containerd $(containerd --version | awk '{print $3}'), runc $(runc --version | awk 'NR==1{print $3}'), buildah $(buildah --version | awk '{print $3}')"
