# syntax=docker/dockerfile:1.7
# The base every pbsd service image starts from: the project and its dependencies in a virtual
# environment, on a slim runtime, as a non-root user. Two flavours from one file:
#   docker build -f deploy/docker/base.Dockerfile --target runtime-cpu  -t pbsd-base:cpu  .
#   docker build -f deploy/docker/base.Dockerfile --target runtime-cuda -t pbsd-base:cuda .
# Both carry the same torch (TORCH_VERSION, the version scripts/bootstrap.sh pins): the CPU build
# from PyTorch's CPU index, the CUDA build from PyPI (CUDA runtime, cuDNN and NCCL as nvidia-*
# wheels, so the image needs no CUDA base image: the NVIDIA Container Toolkit adds the driver).
#
# pip reaches its packages through two build arguments: PIP_OPTIONS, options for every install
# (e.g. "--no-index" for an offline build), and the wheel directory deploy/docker/wheels/, which is
# part of the build context and searched first (deploy/README.md: "Building without a registry").

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG TORCH_VERSION=2.13.0

# -- build stage, CPU: torch's CPU wheel, the project, no compilers left behind -------------------
FROM ${PYTHON_IMAGE} AS build-cpu
ARG TORCH_VERSION
ARG PIP_OPTIONS=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/docker/wheels /wheels
# the +cpu pin: PyPI's Linux torch of the same version is the multi-GB CUDA build
RUN pip install --find-links /wheels $PIP_OPTIONS ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
    "torch==${TORCH_VERSION}+cpu"
COPY pyproject.toml README.md /src/
COPY pbsd /src/pbsd
COPY proto /src/proto
COPY services /src/services
COPY agent /src/agent
COPY worldgen /src/worldgen
COPY demo /src/demo
RUN pip install --find-links /wheels $PIP_OPTIONS "/src[data]"

# -- build stage, CUDA: PyPI's torch (CUDA 13.0 for 2.13.0) and DeepSpeed for the GPU trainer -------
FROM ${PYTHON_IMAGE} AS build-cuda
ARG TORCH_VERSION
ARG PIP_OPTIONS=""
# empty: PyPI's Linux wheel; PyTorch's own index for another CUDA (e.g. .../whl/cu128 for drivers
# older than CUDA 13 needs), where it publishes TORCH_VERSION
ARG TORCH_CUDA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/docker/wheels /wheels
RUN pip install --find-links /wheels $PIP_OPTIONS ${TORCH_CUDA_INDEX_URL:+--index-url "$TORCH_CUDA_INDEX_URL"} \
    "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY pbsd /src/pbsd
COPY proto /src/proto
COPY services /src/services
COPY agent /src/agent
COPY worldgen /src/worldgen
COPY demo /src/demo
RUN pip install --find-links /wheels $PIP_OPTIONS "/src[data,gpu]"

# -- runtime images: the virtual environment, a non-root user, nothing else ------------------------
# /data/* exist and belong to pbsd, so a named volume mounted there starts out writable by it
# (Docker and podman copy the mount point's owner into a new, empty volume).
FROM ${PYTHON_IMAGE} AS runtime-cpu
RUN apt-get update && apt-get install -y --no-install-recommends redis-tools curl && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 pbsd \
    && mkdir -p /data/world /data/runs /data/models /data/datasets && chown -R pbsd /data
COPY --from=build-cpu /opt/venv /opt/venv
COPY assets /opt/pbsd/assets
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PBSD_LOG_LEVEL=INFO
USER pbsd
WORKDIR /data

FROM ${PYTHON_IMAGE} AS runtime-cuda
# gcc and libc6-dev: Triton compiles its kernels' launcher with the system's C compiler at their
# first launch (the scorer's fused LM head, flex attention), and fails without one
RUN apt-get update && apt-get install -y --no-install-recommends redis-tools curl gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 pbsd \
    && mkdir -p /data/world /data/runs /data/models /data/datasets && chown -R pbsd /data
COPY --from=build-cuda /opt/venv /opt/venv
COPY assets /opt/pbsd/assets
# what the NVIDIA Container Toolkit mounts into the container: the CUDA driver and nvidia-smi
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PBSD_LOG_LEVEL=INFO \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER pbsd
WORKDIR /data
