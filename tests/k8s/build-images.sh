#!/usr/bin/env bash
# The images the one-node cluster runs, built here without any registry and written as oci-archives into
# $MINISGL_K8S_IMAGES (start-cluster.sh imports them into containerd):
#   localhost/pause:local             the pod sandbox: a static pause binary (gcc)
#   localhost/debian:bookworm         a Debian rootfs from mmdebstrap (python3, venv), the base of both below
#                                     (in buildah's storage only)
#   docker.io/library/minisgl:0.1.0-cpu   the repository's Dockerfile, CPU variant (BASE above; torch from the
#                                     CPU wheel in $TORCH_WHEEL_DIR, bind-mounted for the build only)
#   docker.io/library/minisgl-operator:0.1.0   operator/Dockerfile on the same base
# Each archive is rebuilt only when its inputs changed (a key over the files that go into it).
# pip inside a build reaches PyPI; where only the host trusts the proxy's CA, PIP_CERT names the host's bundle
# and it is bind-mounted over the image's own bundle for the RUN steps only (never in a layer). Needs: install-node.sh. Run as root.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${MINISGL_K8S_IMAGES:-$HOME/.cache/minisgl-k8s/images}
TORCH_WHEEL_DIR=${TORCH_WHEEL_DIR:-/opt/wheels}
VERSION=$(awk -F'"' '/^version *=/{print $2; exit}' "$ROOT/pyproject.toml")
mkdir -p "$OUT"
W=$(mktemp -d "${TMPDIR:-/tmp}/minisgl-images.XXXXXX"); trap 'rm -rf "$W"' EXIT

key() { # key <paths...>: hash of the files' names and contents (caches, bytecode left out)
  (cd "$ROOT" && find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z \
    | xargs -0 sha256sum) | sha256sum | cut -c1-16; }
fresh() { [ -f "$OUT/$1.oci.tar" ] && [ "$(cat "$OUT/$1.key" 2>/dev/null)" = "$2" ]; }
save() { # save <archive> <key> <image>
  rm -f "$OUT/$1.oci.tar"; buildah push -q "$3" "oci-archive:$OUT/$1.oci.tar:$3"; echo "$2" > "$OUT/$1.key"
  echo "$3: $(du -m "$OUT/$1.oci.tar" | cut -f1) MB archived"; }

# Sandbox image.
if ! fresh pause v1; then
  printf '%s\n' '#include <signal.h>' '#include <stdlib.h>' '#include <unistd.h>' '#include <sys/wait.h>' \
    '/* The pod sandbox: holds its namespaces, reaps orphans, exits on SIGINT/SIGTERM. */' \
    'static void on_term(int s) { (void)s; exit(0); }' \
    'static void on_child(int s) { (void)s; while (waitpid(-1, NULL, WNOHANG) > 0) {} }' \
    'int main(void) {' \
    '  struct sigaction sa = {0}; sa.sa_handler = on_term; sigaction(SIGINT, &sa, NULL); sigaction(SIGTERM, &sa, NULL);' \
    '  sa.sa_handler = on_child; sa.sa_flags = SA_NOCLDSTOP; sigaction(SIGCHLD, &sa, NULL);' \
    '  for (;;) pause(); }' > "$W/pause.c"
  gcc -static -O2 -o "$W/pause" "$W/pause.c"
  c=$(buildah from scratch); buildah copy "$c" "$W/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' "$c"; buildah commit -q "$c" localhost/pause:local >/dev/null; buildah rm "$c" >/dev/null
  save pause v1 localhost/pause:local
fi

# Debian base (the machine's own Debian archive), committed locally.
BASE=localhost/debian:bookworm
BASE_PKGS=python3,python3-venv,ca-certificates,passwd
# (Kept in buildah's storage only: no pod runs it.)
if [ "$(cat "$OUT/base.key" 2>/dev/null)" != "$BASE_PKGS" ] || ! buildah inspect "$BASE" >/dev/null 2>&1; then
  MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  mmdebstrap --variant=apt --include="$BASE_PKGS" --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm "$W/rootfs.tar" "$MIRROR"
  c=$(buildah from scratch); buildah add "$c" "$W/rootfs.tar" / >/dev/null; rm -f "$W/rootfs.tar"
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd '["/bin/bash"]' "$c"
  buildah commit -q "$c" "$BASE" >/dev/null; buildah rm "$c" >/dev/null
  echo "$BASE_PKGS" > "$OUT/base.key"
fi

BUILD=(buildah bud --isolation chroot --layers --build-arg "BASE=$BASE")
# Mounted over paths the base already has, so that no empty mount point is left in a layer.
if [ -n "${PIP_CERT:-}" ]; then
  BUILD+=(--volume "$PIP_CERT:/etc/ssl/certs/ca-certificates.crt:ro" --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
fi

# Server image, CPU variant.
WHEEL=$(find "$TORCH_WHEEL_DIR" -maxdepth 1 -name 'torch-2.13.0+cpu-cp311-*.whl' -printf '%f\n' | head -1)
[ -n "$WHEEL" ] || { echo "no torch 2.13.0 CPU wheel for Python 3.11 in $TORCH_WHEEL_DIR (TORCH_WHEEL_DIR)"; exit 1; }
K=$(key Dockerfile .dockerignore pyproject.toml README.md minisgl)-$(echo "$WHEEL" | sha256sum | cut -c1-8)
if ! fresh minisgl-cpu "$K"; then
  "${BUILD[@]}" --volume "$TORCH_WHEEL_DIR:/mnt:ro" --build-arg "TORCH=/mnt/$WHEEL" \
    -t "docker.io/library/minisgl:$VERSION-cpu" -f "$ROOT/Dockerfile" "$ROOT"
  save minisgl-cpu "$K" "docker.io/library/minisgl:$VERSION-cpu"
fi

# Operator image.
K=$(key operator/Dockerfile operator/requirements.txt operator/minisgl_operator helm)
if ! fresh operator "$K"; then
  "${BUILD[@]}" -t "docker.io/library/minisgl-operator:$VERSION" -f "$ROOT/operator/Dockerfile" "$ROOT"
  save operator "$K" "docker.io/library/minisgl-operator:$VERSION"
fi
ls -la "$OUT"
