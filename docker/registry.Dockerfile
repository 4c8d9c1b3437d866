# syntax=docker/dockerfile:1
# moelora-registry: adapter metadata (SQLite or PostgreSQL) and weights (local or S3).
# The [registry] extra has no GPU stack: torch never enters this image.
# Build from the repository root:
#   docker build -f docker/registry.Dockerfile -t moelora/registry:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# The project as a pure-Python wheel, built from only the packages this service runs.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY moelora/ moelora/
COPY shared/ shared/
COPY registry_service/ registry_service/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS venv
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# Dependencies in a layer of their own: rebuilt only when pyproject.toml changes.
COPY pyproject.toml docker/pyproject_requirements.py ./
RUN python pyproject_requirements.py registry > requirements.txt \
 && pip install --requirement requirements.txt
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-deps /wheels/moe_lora_serve-*.whl

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 moelora \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/moelora \
      --shell /usr/sbin/nologin moelora \
 && install -d -o 10001 -g 10001 /data
COPY --from=venv /opt/venv /opt/venv
# The probe for HEALTHCHECK and `helm test`, and the executor's model fetcher (needs boto3).
COPY docker/grpc_health_probe.py docker/fetch_model.py /opt/moelora/
# Listen on every interface inside the container. No bytecode writes: the chart runs
# with a read-only root filesystem; HOME, /tmp and /data are volumes there.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/moelora \
    MOELORA_REGISTRY_LISTEN=0.0.0.0:50051 \
    MOELORA_REGISTRY_METRICS_LISTEN=0.0.0.0:9401 \
    MOELORA_REGISTRY_HTTP_LISTEN=0.0.0.0:50053 \
    MOELORA_REGISTRY_DATA_DIR=/data
# The commit built, for moelora_build_info: --build-arg COMMIT="$(git rev-parse HEAD)".
ARG COMMIT=unknown
ENV MOELORA_BUILD_COMMIT=${COMMIT}
USER 10001:10001
WORKDIR /home/moelora
EXPOSE 50051 9401 50053
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
  CMD ["python", "/opt/moelora/grpc_health_probe.py", "--service", "moelora.v1.AdapterRegistry"]
ENTRYPOINT ["moelora-registry"]
CMD ["serve"]
