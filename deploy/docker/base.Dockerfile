# syntax=docker/dockerfile:1.7
# The base every pbsd service image starts from: the project and its dependencies in a virtual
# environment, on a slim runtime, as a non-root user. Two flavours from one file:
#   docker build -f deploy/docker/base.Dockerfile --target runtime-cpu  -t pbsd-base:cpu  .
#   docker build -f deploy/docker/base.Dockerfile --target runtime-cuda -t pbsd-base:cuda .

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

# -- build stage, CPU: torch's CPU wheels, the project, no compilers left behind ------------------
FROM ${PYTHON_IMAGE} AS build-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md /src/
COPY pbsd /src/pbsd
COPY proto /src/proto
COPY services /src/services
COPY agent /src/agent
COPY worldgen /src/worldgen
COPY demo /src/demo
RUN pip install "/src[data]"

# -- build stage, CUDA: torch's CUDA wheels and DeepSpeed for the GPU trainer ---------------------
FROM ${CUDA_IMAGE} AS build-cuda
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url https://download.pytorch.org/whl/cu124 torch==2.6.0
COPY pyproject.toml README.md /src/
COPY pbsd /src/pbsd
COPY proto /src/proto
COPY services /src/services
COPY agent /src/agent
COPY worldgen /src/worldgen
COPY demo /src/demo
RUN pip install "/src[data,gpu]"

# -- runtime images: the virtual environment, a non-root user, nothing else ------------------------
FROM ${PYTHON_IMAGE} AS runtime-cpu
RUN apt-get update && apt-get install -y --no-install-recommends redis-tools curl && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 pbsd \
    && mkdir -p /data/world /data/runs /data/models /data/datasets && chown -R pbsd /data
COPY --from=build-cpu /opt/venv /opt/venv
COPY assets /opt/pbsd/assets
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PBSD_LOG_LEVEL=INFO
USER pbsd
WORKDIR /data

FROM ${CUDA_IMAGE} AS runtime-cuda
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 curl && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 pbsd \
    && mkdir -p /data/world /data/runs /data/models /data/datasets && chown -R pbsd /data
COPY --from=build-cuda /opt/venv /opt/venv
COPY assets /opt/pbsd/assets
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PBSD_LOG_LEVEL=INFO
USER pbsd
WORKDIR /data
