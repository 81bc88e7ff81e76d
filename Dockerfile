# syntax=docker/dockerfile:1
# Tessera: OpenAI-compatible serving daemon for vision-language models.
#
#   GPU (default):  docker build -t tessera .
#   CPU:            docker build --build-arg DEVICE=cpu -t tessera:cpu .
#
#   docker run --gpus all -p 8000:8000 \
#       -v /path/Qwen2-VL-2B-Instruct:/models/qwen2-vl:ro tessera --model /models/qwen2-vl
#
# With no --model the image serves the built-in tiny random-weight model (gibberish
# answers; it shows the pipeline working). Models are mounted read-only under /models.
# The install step is the README's: scripts/install.sh, with TESSERA_TORCH /
# TESSERA_TORCH_INDEX choosing the torch build (tests/unit/test_dockerfile.py keeps
# the two from drifting apart). See docs/deploy.md.

ARG DEVICE=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_IMAGE=ubuntu:24.04

# ---- base: the OS and Python, shared by the build and runtime stages -----------------
# Both stages start from the same base so the virtualenv's python symlinks resolve.
FROM ${CUDA_IMAGE} AS base-cuda
FROM ${CPU_IMAGE} AS base-cpu

# hadolint ignore=DL3006
FROM base-${DEVICE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The distribution's python3 (3.12 on ubuntu 24.04), kept current by the base image tag.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# ---- build: create /opt/tessera with scripts/install.sh ------------------------------
FROM base AS build
ARG DEVICE
# The torch build: PyPI's default (CUDA) wheel for GPUs; DEVICE=cpu defaults the index
# to PyTorch's CPU wheels so the image carries no CUDA libraries.
ARG TESSERA_TORCH=torch==2.13.0
ARG TESSERA_TORCH_INDEX=
WORKDIR /opt/tessera-src
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY engine/ engine/
COPY server/ server/
COPY kernels/ kernels/
COPY bench/ bench/
RUN --mount=type=cache,target=/root/.cache/pip \
    set -eu; \
    case "${DEVICE}" in \
        cuda) index="${TESSERA_TORCH_INDEX}"; extras="gpu" ;; \
        cpu) index="${TESSERA_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"; extras="" ;; \
        *) echo "DEVICE must be cuda or cpu, got '${DEVICE}'" >&2; exit 1 ;; \
    esac; \
    TESSERA_VENV=/opt/tessera TESSERA_TORCH="${TESSERA_TORCH}" TESSERA_TORCH_INDEX="${index}" \
        scripts/install.sh ${extras}; \
    /opt/tessera/bin/tessera serve --help > /dev/null

# ---- runtime --------------------------------------------------------------------------
FROM base AS runtime
ARG DEVICE
LABEL org.opencontainers.image.title="tessera" \
      org.opencontainers.image.description="OpenAI-compatible serving for vision-language models" \
      org.opencontainers.image.licenses="Apache-2.0" \
      ai.tessera.device="${DEVICE}"
# A fixed numeric uid (not 1000: ubuntu:24.04 already has a user there) so Kubernetes'
# runAsNonRoot can verify it.
RUN groupadd --system --gid 10001 tessera \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/tessera tessera \
    && mkdir -p /models /var/cache/tessera \
    && chown tessera:tessera /var/cache/tessera
# The install is editable (as in the README), so the source stays at the same path.
COPY --from=build /opt/tessera /opt/tessera
COPY --from=build /opt/tessera-src /opt/tessera-src
# The deployment shapes of configs/, for `--config /etc/tessera/cpu.yaml` and the like.
COPY configs/ /etc/tessera/
ENV PATH=/opt/tessera/bin:${PATH} \
    HOME=/home/tessera \
    TESSERA_HOST=0.0.0.0 \
    TESSERA_PORT=8000 \
    TESSERA_CACHE_DIR=/var/cache/tessera \
    TRITON_CACHE_DIR=/home/tessera/.cache/triton
WORKDIR /home/tessera
USER 10001:10001
VOLUME ["/var/cache/tessera"]
EXPOSE 8000
# Loading a large checkpoint takes a while: a generous start period before failures count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TESSERA_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["tessera", "serve"]
CMD []
