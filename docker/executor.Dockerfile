# syntax=docker/dockerfile:1
# moelora-executor: one per GPU. Built on a CUDA PyTorch image whose torch and triton stay:
# pip installs the [executor] extra with them pinned as constraints, so it never swaps in
# another build, and the build fails if the base image's torch is outside pyproject's range.
# Build from the repository root:
#   docker build -f docker/executor.Dockerfile -t moelora/executor:0.1.0 .
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# The project as a pure-Python wheel, built from only the packages this service runs.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY moelora/ moelora/
COPY shared/ shared/
COPY kernels/ kernels/
COPY executor_service/ executor_service/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
# Triton compiles a small C launcher for each kernel at first use; runtime images ship no
# compiler. Versions follow the base image's distribution release.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install --yes --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 moelora \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/moelora \
      --shell /usr/sbin/nologin moelora \
 && install -d -o 10001 -g 10001 /var/cache/moelora /models
WORKDIR /tmp/deps
# Dependencies in a layer of their own: rebuilt only when pyproject.toml changes.
COPY pyproject.toml docker/pyproject_requirements.py ./
RUN python pyproject_requirements.py executor > requirements.txt \
 && pip list --format=freeze | grep -iE '^(torch|triton)==' > constraints.txt \
 && pip install --requirement requirements.txt --constraint constraints.txt \
 && rm -rf /tmp/deps
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-deps /wheels/moe_lora_serve-*.whl
COPY docker/grpc_health_probe.py /opt/moelora/
# Listen on every interface inside the container. Triton's kernel cache and the adapter
# disk cache live under /var/cache/moelora; the chart runs with a read-only root
# filesystem and mounts volumes there, at HOME and at /tmp.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/moelora \
    TRITON_CACHE_DIR=/var/cache/moelora/triton \
    MOELORA_EXECUTOR_LISTEN=0.0.0.0:50052 \
    MOELORA_EXECUTOR_METRICS_LISTEN=0.0.0.0:9402 \
    MOELORA_EXECUTOR_DISK_CACHE_DIR=/var/cache/moelora/adapters
# The commit built, for moelora_build_info: --build-arg COMMIT="$(git rev-parse HEAD)".
ARG COMMIT=unknown
ENV MOELORA_BUILD_COMMIT=${COMMIT}
USER 10001:10001
WORKDIR /home/moelora
EXPOSE 50052 9402
# Loading a base model onto the GPU can take many minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=1800s --retries=3 \
  CMD ["python", "/opt/moelora/grpc_health_probe.py", "--service", "moelora.v1.Executor"]
ENTRYPOINT ["moelora-executor"]
