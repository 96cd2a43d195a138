# The two commands a newcomer needs are documented in the README: `make demo` (the main job)
# and `make test`. Each bootstraps its own environment first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: bootstrap test test-slow test-gpu demo lint schemas bench-bus

bootstrap:
	./scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/pbsd demo $(ARGS)

test: bootstrap
	$(PY) -m pytest

test-slow: bootstrap
	PBSD_EXTRAS=dev,gpu ./scripts/bootstrap.sh
	$(PY) -m pytest -m "slow and not gpu"

# On a GPU machine: the CUDA paths against the CPU ones (the scorer's packed flex attention and fused
# LM head, a trainer step) and DeepSpeed over NCCL on two GPUs. A venv of its own, $(GPU_VENV), with
# PyPI's Linux torch (the CUDA build, with Triton; PBSD_TORCH to pick another), so that the CPU venv is
# never switched back and forth. Fails where there is no GPU.
GPU_VENV ?= .venv-gpu
test-gpu:
	PBSD_VENV=$(GPU_VENV) PBSD_TORCH=$${PBSD_TORCH:-torch==2.13.0} PBSD_EXTRAS=dev,gpu ./scripts/bootstrap.sh
	$(GPU_VENV)/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: no CUDA device (or a CPU build of torch)')"
	$(GPU_VENV)/bin/python -m pytest -m gpu

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

schemas: bootstrap
	$(VENV)/bin/pbsd schemas export

bench-bus: bootstrap
	$(PY) benchmarks/bus.py
