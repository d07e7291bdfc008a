#!/usr/bin/env bash
# Build Kubernetes v1.20.2 (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy)
# from Debian bookworm's `kubernetes` source package with Debian's Go: apt only, no binary downloads; run
# as root. Also installs etcd. The binaries are cached in $MINISGL_K8S_BIN, keyed on this script's hash
# (bin/.key): built only when missing or when this script changed. About 10 minutes on 2 idle cores.
set -euo pipefail
BIN=${MINISGL_K8S_BIN:-$HOME/.cache/minisgl-k8s/bin}
KEY=$(sha256sum "$0" | cut -c1-16)
WHAT="kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy"
if [ "$(cat "$BIN/.key" 2>/dev/null)" = "$KEY" ] && command -v etcd >/dev/null; then
  echo "Kubernetes binaries and etcd present ($BIN, key $KEY)"; exit 0
fi
W=$(mktemp -d "${TMPDIR:-/tmp}/minisgl-k8s-build.XXXXXX")
trap 'rm -rf "$W"' EXIT
if ! grep -rqs '^Types: deb-src' /etc/apt/sources.list.d/ /etc/apt/sources.list; then
  # source packages from the machine's own Debian archive
  sed -n '/^Types: deb$/,/^$/p' /etc/apt/sources.list.d/debian.sources | sed '/^#/d; s/^Types: deb$/Types: deb-src/' \
    | awk 'BEGIN{RS=""; ORS="\n\n"} NR==1' > /etc/apt/sources.list.d/debian-src.sources
fi
apt-get update -q
apt-get install -y -q --no-install-recommends golang-go dpkg-dev rsync jq etcd-server \
    golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev
cd "$W"
apt-get source --download-only kubernetes        # 1.20.5+really1.20.2, the full tree with vendor/
dpkg-source -x kubernetes_*.dsc k8s >/dev/null
cd k8s
# Go >= 1.18 crashes the vendored reflect2 1.0.1 ("fatal error: fault" in mapiter): use Debian's newer
# reflect2 and json-iterator instead.
for m in modern-go/reflect2 json-iterator/go; do
  rm -rf "vendor/github.com/$m"; cp -rL "/usr/share/gocode/src/github.com/$m" "vendor/github.com/$m"
  rm -f "vendor/github.com/$m/go.mod" "vendor/github.com/$m/go.sum"
done
mkdir -p .go/src/k8s.io && ln -sfn ../../.. .go/src/k8s.io/kubernetes
export GOPATH=$PWD/.go CGO_ENABLED=0 HOME=$W/home; mkdir -p "$HOME"
make WHAT="$(for b in $WHAT; do printf 'cmd/%s ' "$b"; done)"
mkdir -p "$BIN"
for b in $WHAT; do cp "_output/bin/$b" "$BIN/"; done
echo "$KEY" > "$BIN/.key"
ls -la "$BIN"
