#!/usr/bin/env bash
# The server's CUDA variant from the same Dockerfile, built here once as a check that the file still builds
# it: BASE = the local Debian base of build-images.sh (run that first), torch = PyPI's torch==2.13.0, whose
# wheel is the CUDA build and brings its CUDA libraries (several GB of downloads). Then, inside the image,
# torch must report a CUDA version and `python -m minisgl --help` must run. Prints the image's size, then
# removes it (5.5 GB).
# Not part of every CI run (too slow for 2 cores); no GPU is needed to build or check it. Run as root.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BASE=localhost/debian:bookworm
VERSION=$(awk -F'"' '/^version *=/{print $2; exit}' "$ROOT/pyproject.toml")
IMAGE=localhost/minisgl:$VERSION-cuda-check
buildah inspect "$BASE" >/dev/null 2>&1 || { echo "no $BASE: run tests/k8s/build-images.sh first"; exit 1; }
BUILD=(buildah bud --isolation chroot --build-arg "BASE=$BASE")   # no --layers: nothing of it is kept
if [ -n "${PIP_CERT:-}" ]; then   # as in build-images.sh: over the base's own bundle, for the build only
  BUILD+=(--volume "$PIP_CERT:/etc/ssl/certs/ca-certificates.crt:ro" --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
fi
t0=$SECONDS
"${BUILD[@]}" -t "$IMAGE" -f "$ROOT/Dockerfile" "$ROOT"
echo "built in $((SECONDS - t0)) s"
c=$(buildah from "$IMAGE"); trap 'buildah rm "$c" >/dev/null; buildah rmi "$IMAGE" >/dev/null' EXIT
buildah run --isolation chroot "$c" -- python -c \
  'import torch; assert torch.version.cuda, "torch has no CUDA"; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
buildah run --isolation chroot "$c" -- python -m minisgl --help | head -1
echo "$IMAGE: $(buildah images --format '{{.Size}}' "$IMAGE") unpacked"
