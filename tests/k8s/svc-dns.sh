#!/usr/bin/env bash
# Cluster DNS records without CoreDNS: every second, write each Service's ClusterIP as
# <svc>.<ns>.svc.cluster.local into a hosts file that dnsmasq (--hostsdir) re-reads when it changes.
# Usage: svc-dns.sh KUBECONFIG HOSTS_DIR (the file is written next to it first: dnsmasq reads the whole dir)
set -uo pipefail
KC=$1 OUT=$2/services NEW=$2.new
while :; do
  kubectl --kubeconfig="$KC" get svc -A -o json 2>/dev/null | jq -r '.items[]
    | select(.spec.clusterIP != null and .spec.clusterIP != "None")
    | "\(.spec.clusterIP) \(.metadata.name).\(.metadata.namespace).svc.cluster.local"' > "$NEW"
  if cmp -s "$NEW" "$OUT"; then rm -f "$NEW"; else mv "$NEW" "$OUT"; fi
  sleep 1
done
