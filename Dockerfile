# minisgl server image: `python -m minisgl` on port 1919, as an unprivileged user.
#
#   docker build -t minisgl:0.1.0 .                                         # CUDA (default)
#   docker build -t minisgl:0.1.0-cpu --build-arg BASE=debian:12.11-slim \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .  # CPU (demo, tests)
#   docker run --gpus all -p 1919:1919 -v hf-cache:/home/minisgl/.cache minisgl:0.1.0 \
#       --model Qwen/Qwen3-0.6B --host 0.0.0.0
#
# Without a registry (tests/k8s/build-images.sh): BASE is a locally committed Debian rootfs and TORCH a
# wheel file bind-mounted for the build (buildah bud -v DIR:/mnt --build-arg TORCH=/mnt/torch-...whl).
#
# BASE must be Debian or Ubuntu with Python >= 3.10 in apt. The default is a pinned CUDA runtime of the
# same major version as PyPI's torch 2.13.0 wheel (cu130), so the node needs a driver for CUDA 13 (>= 580);
# the wheel brings its own CUDA libraries, the base brings the driver glue the NVIDIA runtime expects.
ARG BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

# Build stage: a virtual environment with PyTorch, the dependencies and minisgl itself.
FROM ${BASE} AS build
ARG TORCH_VERSION=2.13.0
# PyPI's wheel is the CUDA build on Linux x86_64; the CPU image uses PyTorch's CPU index.
ARG TORCH_INDEX_URL=https://pypi.org/simple
# What pip installs as torch: the pinned version from the index above, or a wheel file the build mounts.
ARG TORCH=torch==${TORCH_VERSION}
# A CA bundle for pip where PyPI is reached through a TLS-intercepting proxy: a path mounted for the build
# only (unset by default; the runtime stage never sees it).
ARG PIP_CERT
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The versions are the base release's own: pinning them here would tie this file to one base.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# TORCH pins the version (torch==VERSION, or a wheel file of it); hadolint cannot see through the variable.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY minisgl ./minisgl
# csrc/ (the CUDA C++ FP8 decode GEMVs) is not built here: the CUDA runtime base has no nvcc. minisgl then
# serves FP8 with its Triton kernels, silently; a library built elsewhere (python -m minisgl.tools.build_csrc)
# can be mounted and named by MINISGL_CSRC_LIB.
# `.` is this repository, not a registry package (DL3013 mistakes it for one).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . && python -c "import minisgl, torch; print('torch', torch.__version__)"

# Runtime stage: the same base with Python only, the environment, and a non-root user whose home
# (Hugging Face cache, kernel caches) is a volume.
FROM ${BASE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 minisgl \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/minisgl --shell /usr/sbin/nologin minisgl \
 && mkdir -p /home/minisgl/.cache/huggingface && chown -R 10001:10001 /home/minisgl
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/minisgl \
    HF_HOME=/home/minisgl/.cache/huggingface \
    TRITON_CACHE_DIR=/home/minisgl/.cache/triton \
    PYTHONUNBUFFERED=1
VOLUME ["/home/minisgl/.cache"]
WORKDIR /home/minisgl
USER 10001:10001
EXPOSE 1919
ENTRYPOINT ["python", "-m", "minisgl"]
CMD ["--help"]
