# syntax=docker/dockerfile:1
# infergate gateway: a slim CPU image (also runs CPU workers: the cpu-demo overlay).
#
#   docker build -f deploy/docker/gateway.Dockerfile -t infergate/gateway:0.1.0 .
#   docker run --rm -p 8000:8000 -p 8001:8001 infergate/gateway:0.1.0 \
#       gateway --host 0.0.0.0 --worker HOST:PORT
#
# Build from the repository root. The base image is pinned by tag; pin its
# digest too (python@sha256:...) where builds must be reproducible.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/infergate
COPY deploy/docker/requirements-gateway.txt /tmp/requirements.txt
RUN /opt/infergate/bin/pip install -r /tmp/requirements.txt
COPY pyproject.toml README.md /src/
COPY infergate /src/infergate
COPY gateway /src/gateway
COPY workers /src/workers
COPY execution /src/execution
COPY splitter /src/splitter
COPY batchjobs /src/batchjobs
COPY serverkit /src/serverkit
COPY protos /src/protos
COPY loadtest /src/loadtest
COPY models /src/models
# Dependencies came pinned from the requirements file; install only the project.
RUN /opt/infergate/bin/pip install --no-deps /src

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 infergate \
 && useradd --system --uid 10001 --gid infergate --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin infergate
COPY --from=build /opt/infergate /opt/infergate
COPY deploy/docker/gateway.yaml /etc/infergate/gateway.yaml
ENV PATH=/opt/infergate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2).status != 200)"]
ENTRYPOINT ["infergate"]
CMD ["gateway", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "8001", "--config", "/etc/infergate/gateway.yaml"]
