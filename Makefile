# The two commands a newcomer needs are documented in the README: `make demo` (the main job)
# and `make test`. Each bootstraps its own environment first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: bootstrap test test-slow test-gpu test-deploy demo lint schemas bench-bus

bootstrap:
	./scripts/bootstrap.sh

# the demo needs no browser: bootstrap leaves Chromium (the viewer's browser test) out
demo:
	PBSD_BROWSER=0 ./scripts/bootstrap.sh
	$(VENV)/bin/pbsd demo $(ARGS)

test: bootstrap
	$(PY) -m pytest

test-slow: bootstrap
	PBSD_EXTRAS=dev,gpu ./scripts/bootstrap.sh
	$(PY) -m pytest -m "slow and not gpu"

# On a GPU machine: the CUDA paths against the CPU ones (the scorer's packed flex attention and fused
# LM head, a trainer step) and DeepSpeed over NCCL on one and two GPUs. A venv of its own, $(GPU_VENV), with
# PyPI's Linux torch (the CUDA build, with Triton; PBSD_TORCH to pick another), so that the CPU venv is
# never switched back and forth. Fails where there is no GPU.
GPU_VENV ?= .venv-gpu
test-gpu:
	PBSD_VENV=$(GPU_VENV) PBSD_TORCH=$${PBSD_TORCH:-torch==2.13.0} PBSD_EXTRAS=dev,gpu ./scripts/bootstrap.sh
	$(GPU_VENV)/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: no CUDA device (or a CPU build of torch)')"
	$(GPU_VENV)/bin/python -m pytest -m gpu

# The Compose stack for real: the cpu profile's images built, the stack up and healthy, a short
# run trained through it with a worker crashed mid-run, Prometheus and every dashboard query
# checked (tests/test_deploy_stack.py). Sets up its engine itself (scripts/deploy-setup.sh: Docker,
# else podman from the OS packages, stand-in base images where no registry answers). With podman it
# runs as root (rootful podman: the images the setup builds are the ones the stack runs); about
# 6 GB of disk.
test-deploy:
	PBSD_EXTRAS=dev,deploy ./scripts/bootstrap.sh
	$(PY) -m pytest -m deploy -p no:cacheprovider -s tests/test_deploy_stack.py

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

schemas: bootstrap
	$(VENV)/bin/pbsd schemas export

bench-bus: bootstrap
	$(PY) benchmarks/bus.py
