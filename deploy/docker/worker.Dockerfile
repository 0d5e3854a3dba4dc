# syntax=docker/dockerfile:1
# infergate worker: ONNX Runtime on CUDA (falls back to the CPU without a GPU).
#
#   docker build -f deploy/docker/worker.Dockerfile -t infergate/worker:0.1.0 .
#   docker run --rm --gpus all -p 8001:8001 -p 8002:8002 infergate/worker:0.1.0
#
# Serves the example models built into /models; mount another Triton-layout
# repository over /models to serve yours. Build from the repository root.
# It also runs a gateway for clients on a GPU host that use Triton's CUDA
# shared memory (cuda-python is installed; the client, the gateway and the GPU
# must share the host, and the container needs the GPU and --ipc=host):
#   docker run --rm --gpus all --ipc=host -p 8000:8000 -p 8003:8001 infergate/worker:0.1.0 \
#       gateway --host 0.0.0.0 --worker HOST:PORT
# onnxruntime-gpu 1.31 needs CUDA 13 and cuDNN 9, hence this base; pin its
# digest too (nvidia/cuda@sha256:...) where builds must be reproducible.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS base
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

FROM base AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/infergate
COPY deploy/docker/requirements-worker.txt /tmp/requirements.txt
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
RUN /opt/infergate/bin/pip install --no-deps /src \
 && /opt/infergate/bin/infergate models build /models

FROM base
RUN groupadd --system --gid 10001 infergate \
 && useradd --system --uid 10001 --gid infergate --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin infergate
COPY --from=build /opt/infergate /opt/infergate
COPY --from=build /models /models
ENV PATH=/opt/infergate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8001 8002
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel('127.0.0.1:8001')).Check(h.HealthCheckRequest(service=''), timeout=2); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["infergate"]
CMD ["worker", "--model-repository", "/models", "--host", "0.0.0.0", "--port", "8001", "--metrics-port", "8002", "--device", "auto"]
