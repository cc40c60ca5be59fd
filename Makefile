# Two set-up commands: `make demo` and `make test`. Both create or update .venv.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint typecheck pytest bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]" "$(TORCH_SPEC)"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m edgeinfer.daemon.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-logo

typecheck: $(STAMP)
	$(VENV)/bin/mypy shared/edgeinfer/shared router/edgeinfer edge-daemon/edgeinfer/daemon kernels/edgeinfer/kernels

pytest: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache

# Three PoPs in network namespaces behind delayed links (needs root and iproute2, else skips).
.PHONY: netns-test
netns-test: $(STAMP)
	$(PY) -m pytest -v -s tests/test_netns.py
