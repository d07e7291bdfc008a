#!/usr/bin/env bash
# Build kube-apiserver and kube-controller-manager v1.20.2 from Debian bookworm's `kubernetes` source
# package with Debian's Go, for the operator tests (no binary downloads: apt only; run as root).
# Also installs etcd. Skips the build when the binaries are already in $MINISGL_K8S_BIN.
# About 4 minutes on 2 idle cores.
set -euo pipefail
BIN=${MINISGL_K8S_BIN:-$HOME/.cache/minisgl-k8s/bin}
if [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kube-controller-manager" ] && command -v etcd >/dev/null; then
  echo "kube-apiserver, kube-controller-manager and etcd present ($BIN)"; exit 0
fi
W=$(mktemp -d "${TMPDIR:-/tmp}/minisgl-k8s-build.XXXXXX")
trap 'rm -rf "$W"' EXIT
if ! grep -rqs '^Types: deb-src' /etc/apt/sources.list.d/ /etc/apt/sources.list; then
  printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    > /etc/apt/sources.list.d/debian-src.sources
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
make WHAT="cmd/kube-apiserver cmd/kube-controller-manager"
mkdir -p "$BIN"
cp _output/bin/kube-apiserver _output/bin/kube-controller-manager "$BIN"/
ls -la "$BIN"
