# The two commands a newcomer needs are documented in the README: `make demo` (the main job)
# and `make test`. Each bootstraps its own environment first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: bootstrap test test-slow demo lint schemas bench-bus

bootstrap:
	./scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/pbsd demo $(ARGS)

test: bootstrap
	$(PY) -m pytest

test-slow: bootstrap
	PBSD_EXTRAS=dev,gpu ./scripts/bootstrap.sh
	$(PY) -m pytest -m slow

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

schemas: bootstrap
	$(VENV)/bin/pbsd schemas export

bench-bus: bootstrap
	$(PY) benchmarks/bus.py
