#!/usr/bin/env bash
# Debian packages the one-node cluster and the local image builds need (apt only; run as root):
# containerd 1.6 + runc, the CNI plugins, iptables/conntrack (kube-proxy), dnsmasq (cluster DNS),
# buildah + mmdebstrap (images without a registry), gcc (the pause image), and kubectl (Debian's
# kubernetes-client, v1.20.2 like the cluster) unless one is installed. Skips apt when all are there.
set -euo pipefail
need=(containerd runc /usr/lib/cni/bridge iptables conntrack dnsmasq jq buildah mmdebstrap gcc etcd kubectl)
missing=0
for c in "${need[@]}"; do command -v "$c" >/dev/null || [ -x "$c" ] || missing=1; done
[ -f /usr/include/stdio.h ] || missing=1
if [ $missing = 1 ]; then
  extra=(); command -v kubectl >/dev/null || extra=(kubernetes-client)
  apt-get update -q
  apt-get install -y -q --no-install-recommends containerd runc containernetworking-plugins iptables conntrack \
    dnsmasq-base jq buildah mmdebstrap gcc libc6-dev etcd-server uidmap fuse-overlayfs "${extra[@]}"
fi
echo "node packages: containerd $(containerd --version | awk '{print $3}'), runc $(runc --version | awk 'NR==1{print $3}'), buildah $(buildah --version | awk '{print $3}')"
