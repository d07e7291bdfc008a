#!/usr/bin/env bash
# A real one-node Kubernetes v1.20.2 on this machine, for the node tests and for trying the chart locally:
#   network   bridge k8sbr0 = the node IP 10.244.0.1/24; pods 10.244.0.0/24, Services 10.96.0.0/16, both
#             routed onto the bridge only; forwarding from the bridge to anything else is rejected
#   control   etcd (127.0.0.1), kube-apiserver (10.244.0.1: pods reach it through the `kubernetes` Service
#             with ServiceAccount tokens; the host through the bridge IP), kube-controller-manager, kube-scheduler
#   node      containerd + runc (CRI, cgroupfs, overlayfs), the CNI bridge, kubelet, kube-proxy (iptables),
#             cluster DNS (dnsmasq fed from the API by svc-dns.sh; no upstream: outside names fail at once)
# Binaries: build-binaries.sh. Images: build-images.sh (its oci-archives are imported; no registry).
# Run as root; stop with stop-cluster.sh, which puts back everything this changes. Prints KUBECONFIG=... last.
set -euo pipefail
H=$(cd "$(dirname "$0")" && pwd)
BIN=${MINISGL_K8S_BIN:-$HOME/.cache/minisgl-k8s/bin}
IMAGES=${MINISGL_K8S_IMAGES:-$HOME/.cache/minisgl-k8s/images}
R=${MINISGL_K8S_RUN:-${TMPDIR:-/tmp}/minisgl-k8s}
# containerd's root (image content and snapshots) is a cache like the archives: importing the server image
# takes most of a start, so an archive is imported again only when it was rebuilt.
CROOT=${MINISGL_K8S_CONTAINERD:-$HOME/.cache/minisgl-k8s/containerd}
NODE_IP=10.244.0.1 API_PORT=16443 ETCD_PORT=23790
NODE=${NODE_NAME:-$(hostname | tr '[:upper:]' '[:lower:]')}
SOCK=/run/minisgl-k8s/containerd.sock
KC=$R/kubeconfig
[ -e "$R/pids" ] && [ -n "$(ls "$R/pids")" ] && { echo "$R/pids is not empty: run stop-cluster.sh first"; exit 1; }
rm -rf "$R"; mkdir -p "$R/pids" "$R/logs" "$R/certs" "$R/etcd" "$R/cni/net.d" "$R/cni/ipam" "$R/dns/hosts" /run/minisgl-k8s

ts() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(ts)" 'BEGIN{printf "%.1fs", b-a}'; }
spawn() { # spawn <name> <cmd...>: in the background, logged, its PID saved for stop-cluster.sh
  local name=$1; shift; "$@" > "$R/logs/$name.log" 2>&1 & echo $! > "$R/pids/$name"; }
wait_for() { # wait_for <name> <timeout_s> <cmd...>: until cmd succeeds, while process <name> lives
  local name=$1 t=$2 t0; shift 2; t0=$(ts)
  for _ in $(seq 1 $((t * 5))); do
    "$@" >/dev/null 2>&1 && { echo "${WHAT:-$name up} in $(since "$t0")"; return 0; }
    kill -0 "$(cat "$R/pids/$name")" 2>/dev/null || { echo "$name exited:"; tail -20 "$R/logs/$name.log"; exit 1; }
    sleep 0.2
  done; echo "$name not up after ${t}s:"; tail -20 "$R/logs/$name.log"; exit 1; }
T0=$(ts)

# Kernel settings this script, kubelet and kube-proxy change: saved once, put back by stop-cluster.sh.
for k in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys \
         kernel/keys/root_maxbytes net/ipv4/ip_forward net/bridge/bridge-nf-call-iptables \
         net/ipv4/conf/all/route_localnet net/netfilter/nf_conntrack_max; do
  [ -e "/proc/sys/$k" ] && echo "$k $(cat "/proc/sys/$k")"
done > "$R/sysctl.saved"
echo 1 > /proc/sys/net/ipv4/ip_forward
echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables   # pod -> ClusterIP -> pod on the same bridge

# Network: the bridge owns the node IP, Services are routed onto it, and nothing from it is forwarded out.
ip link add k8sbr0 type bridge; ip addr add $NODE_IP/24 dev k8sbr0; ip link set k8sbr0 up
ip route replace 10.96.0.0/16 dev k8sbr0 src $NODE_IP
iptables -I FORWARD -i k8sbr0 ! -o k8sbr0 -j REJECT

# Control plane.
openssl genrsa -out "$R/certs/sa.key" 2048 2>/dev/null
echo "admin-token,admin,admin,system:masters" > "$R/tokens.csv"
spawn etcd etcd --data-dir "$R/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
  --unsafe-no-fsync=true
spawn apiserver "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address=$NODE_IP --advertise-address=$NODE_IP --secure-port=$API_PORT --insecure-port=0 \
  --cert-dir="$R/certs" --token-auth-file="$R/tokens.csv" --authorization-mode=RBAC \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$R/certs/sa.key" \
  --service-account-signing-key-file="$R/certs/sa.key" --service-cluster-ip-range=10.96.0.0/16 \
  --kubelet-preferred-address-types=InternalIP --allow-privileged=false
cat > "$KC" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters: [{name: minisgl, cluster: {server: "https://$NODE_IP:$API_PORT", insecure-skip-tls-verify: true}}]
users: [{name: admin, user: {token: admin-token}}]
contexts: [{name: minisgl, context: {cluster: minisgl, user: admin, namespace: default}}]
current-context: minisgl
KUBECONFIG
export KUBECONFIG=$KC
wait_for apiserver 120 sh -c "curl -sk -H 'Authorization: Bearer admin-token' https://$NODE_IP:$API_PORT/readyz | grep -qx ok"
spawn controller-manager "$BIN/kube-controller-manager" --kubeconfig="$KC" --authentication-kubeconfig="$KC" \
  --authorization-kubeconfig="$KC" --bind-address=127.0.0.1 --port=0 --secure-port=$((API_PORT + 1)) \
  --leader-elect=false --service-account-private-key-file="$R/certs/sa.key" \
  --root-ca-file="$R/certs/apiserver.crt" --use-service-account-credentials=false
spawn scheduler "$BIN/kube-scheduler" --kubeconfig="$KC" --authentication-kubeconfig="$KC" \
  --authorization-kubeconfig="$KC" --bind-address=127.0.0.1 --port=0 --secure-port=10259 --leader-elect=false
wait_for scheduler 60 curl -skf https://127.0.0.1:10259/healthz

# containerd: its own socket, state and root under $R. This machine's root lacks CAP_SYS_RESOURCE, so the
# CRI may not lower oom_score_adj (restrict_oom_score_adj).
sed "s#@R@#$R#g" > "$R/cni/net.d/10-minisgl.conflist" <<'CNI'
{"cniVersion": "0.4.0", "name": "minisgl", "plugins": [
  {"type": "bridge", "bridge": "k8sbr0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24", "gateway": "10.244.0.1"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "@R@/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
CNI
cat > "$R/containerd.toml" <<TOML
version = 2
root = "$CROOT"
state = "/run/minisgl-k8s/containerd"
[grpc]
  address = "$SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:local"
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$R/cni/net.d"
TOML
spawn containerd containerd --config "$R/containerd.toml"
wait_for containerd 30 ctr -a $SOCK version
t0=$(ts); mkdir -p "$CROOT/imported"
for f in "$IMAGES"/*.oci.tar; do
  name=$(basename "$f" .oci.tar)
  cmp -s "$IMAGES/$name.key" "$CROOT/imported/$name.key" && continue
  ctr -a $SOCK -n k8s.io images import "$f" >/dev/null && cp "$IMAGES/$name.key" "$CROOT/imported/$name.key"
done
echo "images imported in $(since "$t0"): $(ctr -a $SOCK -n k8s.io images ls -q | grep -v '^sha256:' | tr '\n' ' ')"

# Cluster DNS on the node IP.
spawn dnsmasq dnsmasq --keep-in-foreground --no-resolv --no-hosts --listen-address=$NODE_IP --bind-interfaces \
  --hostsdir="$R/dns/hosts" --local=/cluster.local/ --pid-file= --log-facility=-
spawn svc-dns "$H/svc-dns.sh" "$KC" "$R/dns/hosts"

spawn kubelet "$BIN/kubelet" --kubeconfig="$KC" --hostname-override="$NODE" --node-ip=$NODE_IP --address=$NODE_IP \
  --container-runtime=remote --container-runtime-endpoint=unix://$SOCK --image-service-endpoint=unix://$SOCK \
  --runtime-request-timeout=5m --node-status-update-frequency=2s --pod-infra-container-image=localhost/pause:local \
  --cgroup-driver=cgroupfs --fail-swap-on=false --oom-score-adj=0 --root-dir="$R/kubelet" \
  --volume-plugin-dir="$R/kubelet-plugins" --read-only-port=0 --healthz-bind-address=127.0.0.1 --healthz-port=10248 \
  --eviction-hard='memory.available<100Mi,nodefs.available<2%,imagefs.available<2%' \
  --image-gc-high-threshold=99 --image-gc-low-threshold=98 --cluster-domain=cluster.local --cluster-dns=$NODE_IP \
  --resolv-conf=/etc/resolv.conf --v=1
wait_for kubelet 120 curl -sf http://127.0.0.1:10248/healthz
spawn proxy "$BIN/kube-proxy" --kubeconfig="$KC" --hostname-override="$NODE" --bind-address=$NODE_IP \
  --proxy-mode=iptables --cluster-cidr=10.244.0.0/24 --conntrack-max-per-core=0 --oom-score-adj=0 \
  --metrics-bind-address=127.0.0.1:10249 --healthz-bind-address=127.0.0.1:10256
wait_for proxy 60 curl -sf http://127.0.0.1:10256/healthz
WHAT="node Ready" wait_for kubelet 120 sh -c "kubectl get node '$NODE' -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
echo "cluster up in $(since "$T0")"
echo "KUBECONFIG=$KC"
