# infergate: `make up` serves the example models on a local cluster,
# `make test` runs the test suite. Both install what they need first.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.infergate-installed
MODELS_STAMP := models/.built

WORKERS ?= 2
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
PYTEST_ARGS ?=
UP_ARGS ?=

.PHONY: install models up test bench k8s-check images deploy-check deploy-tools browser clean

install: $(STAMP) $(MODELS_STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

$(MODELS_STAMP): $(STAMP) $(wildcard models/*.py)
	$(VENV)/bin/infergate models build models
	@touch $(MODELS_STAMP)

models: $(MODELS_STAMP)

up: install
	$(VENV)/bin/infergate up --workers $(WORKERS) --model-repository models --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) $(UP_ARGS)

# Headless Chromium for the dashboard's browser test (Debian's package).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

k8s-check: $(STAMP)
	$(PY) deploy/k8s_check.py

# What images and deploy-check run (Debian's packages), installed where missing as
# `browser` installs Chromium: as root, or with sudo. Where that cannot be done (no
# apt-get, neither root nor sudo) it says why and the check after it skips.
DEPLOY_TOOLS := podman buildah runc debootstrap

deploy-tools:
	@missing=$$(for tool in $(DEPLOY_TOOLS); do \
	  command -v $$tool >/dev/null 2>&1 || [ -x /usr/sbin/$$tool ] || printf '%s ' $$tool; done); \
	missing=$${missing% }; \
	if [ -n "$$missing" ]; then \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "deploy-tools: not installing $$missing: no apt-get here (install them with this system's packages)"; \
	  elif [ "$$(id -u)" != 0 ] && ! command -v sudo >/dev/null 2>&1; then \
	    echo "deploy-tools: not installing $$missing: needs root or sudo"; \
	  else \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    echo "deploy-tools: installing $$missing"; \
	    $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  fi; \
	fi

# Both images built with podman from deploy/docker/*.Dockerfile on a Debian base
# made here (debootstrap; needs root); users build the same files on python:3.x-slim.
images: $(STAMP) deploy-tools
	$(PY) deploy/deploy_check.py images

# Not part of `make test`: builds the images, plays deploy/k8s with podman, sends
# requests, kills a worker, removes everything it made. Installs podman, buildah,
# runc and debootstrap first where missing (deploy-tools); skips (exit 0), saying
# why, only where podman still cannot start containers.
deploy-check: $(STAMP) $(MODELS_STAMP) deploy-tools
	$(PY) deploy/deploy_check.py check

test: install browser
	$(PY) deploy/k8s_check.py
	$(PY) -m pytest -q $(PYTEST_ARGS)

# encoder_large (~200 MB) is built for the benchmark only, outside the example repository.
LARGE_MODELS := $(VENV)/large-models

bench: install
	$(VENV)/bin/infergate models build $(LARGE_MODELS) --large
	$(PY) -m loadtest.suite --out bench --large-repository $(LARGE_MODELS)

clean:
	rm -rf $(VENV) $(MODELS_STAMP) models/*/1/model.onnx models/*/1/model.py .pytest_cache .hypothesis
