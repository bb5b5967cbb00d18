# Every target creates .venv when it is missing, so a fresh machine needs only `make demo` / `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-deploy bench lint proto venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,ray]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedatoms demo

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadscope --durations=25 -m "not slow"

# the longest real-process runs (tests marked slow: tests/conftest.py's SLOW and the files marked so)
test-slow: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadscope --durations=25 -m slow

# deploy/ for real: base image (once), images (cached layers), compose and `podman kube play` federations;
# prints why and exits 0 where podman cannot run containers (tests/deploy/run.sh, docs/deploy.md)
test-deploy: $(STAMP)
	PY=$(PY) tests/deploy/run.sh

bench: $(STAMP)
	$(PY) benchmarks/layers.py
	$(PY) benchmarks/aggregation.py
	$(PY) benchmarks/transport.py
	$(PY) benchmarks/rounds.py
	$(PY) benchmarks/dashboard.py

proto: $(STAMP)
	$(PY) -m fedwire.protogen

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy fedcore

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
