# syntax=docker/dockerfile:1
# The qwen-serve image: every stage (`qwen-serve serve <stage>`) and the operator (`qwen-serve operator`).
#
#   docker build -t qwen-serve:0.1.0 .                      # CPU (default target)
#   docker build --target cuda -t qwen-serve:0.1.0-cuda .   # CUDA + the gpu extra's kernel packages
#
# Both targets install torch first, from the index that matches the hardware, so that `pip install .`
# finds torch satisfied and never pulls a second (CUDA) build into the CPU image.

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
# Base images of the cuda target (ARGs used in FROM must come before the first FROM).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# --------------------------------------------------------------------------------------------- cuda
# Build stage: the CUDA toolkit compiles flash-attn and causal-conv1d (flash-linear-attention is Triton, compiled at
# run time); only the virtual environment is kept.
FROM ${CUDA_IMAGE} AS cuda-build
ARG TORCH_VERSION
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MAX_JOBS=8
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" && pip install packaging ninja wheel "setuptools>=77"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY qwenserve/ qwenserve/
COPY services/ services/
COPY operator/ operator/
COPY devcluster/ devcluster/
# Extras: mooncake for `kvTransfer.mode: mooncake` (Mooncake Transfer Engine; libibverbs1 even over TCP), hf for
# `model.source: hf` (the fetch-model init container), operator for `qwen-serve operator`. Not devcluster or
# bench: the image runs stages and the operator (`qwen-serve dev-cluster` here says which extra it lacks).
RUN pip install ".[gpu,mooncake,hf,operator]" --no-build-isolation
# The CPU kernels (the KV handoff's checksum and copies run on the host here too), one object per instruction-set
# level, inside the installed package; from / so that the installed package, not /src, is the one built into.
RUN cd / && python -m qwenserve.cpu_kernels build

FROM ${CUDA_RUNTIME_IMAGE} AS cuda
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp \
    PATH=/opt/venv/bin:$PATH
# gcc and Python's headers: Triton (flash-linear-attention's kernels) compiles its launchers at run time.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev libibverbs1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 qwen && useradd --system --uid 10001 --gid qwen --home-dir /tmp qwen \
    && mkdir -p /models && chown qwen:qwen /models
COPY --from=cuda-build /opt/venv /opt/venv
WORKDIR /tmp
USER 10001:10001
EXPOSE 50050 50051 50052 50053 8000 9090
ENTRYPOINT ["qwen-serve"]
CMD ["--help"]

# ---------------------------------------------------------------------- cpu (last: the default target)
FROM python:${PYTHON_VERSION}-slim AS cpu
ARG TORCH_VERSION
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
WORKDIR /src
# A C compiler: the CPU kernels are built below, one object per instruction-set level, and each pod loads the
# best its node runs (it compiles at first use only where none was built).
# libibverbs1: Mooncake Transfer Engine (kvTransfer.mode: mooncake) loads it even over TCP.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libibverbs1 \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
# What the package build needs, and nothing else (.dockerignore keeps tests, charts and caches out).
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY qwenserve/ qwenserve/
COPY services/ services/
COPY operator/ operator/
COPY devcluster/ devcluster/
# Extras: mooncake (kvTransfer.mode: mooncake), hf (model.source: hf, the fetch-model init container), operator
# (`qwen-serve operator`); not devcluster or bench, which the image does not run.
RUN pip install ".[mooncake,hf,operator]" && rm -rf /src
RUN cd / && python -m qwenserve.cpu_kernels build
# A fixed non-root UID: the operator's pod securityContext (runAsUser 10001) matches it.
RUN groupadd --system --gid 10001 qwen && useradd --system --uid 10001 --gid qwen --home-dir /tmp qwen \
    && mkdir -p /models && chown qwen:qwen /models
# The built-in default model (a small random Qwen3 with the real vocabulary; nothing downloaded), baked for
# examples/qwendeployment-cpu.yaml (model.source: image, model.path: this folder). Read-only for the pods.
RUN HOME=/root qwen-serve model init --dir /models/qwen3-tiny-random-v1 && rm -rf /root/.cache
WORKDIR /tmp
USER 10001:10001
EXPOSE 50050 50051 50052 50053 8000 9090
ENTRYPOINT ["qwen-serve"]
CMD ["--help"]
