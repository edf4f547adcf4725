# `make demo` and `make test` each do the whole set-up on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_DIR ?= runs/demo
PYTEST_ARGS ?=

.PHONY: setup system-deps demo test test-slow lint bench clean

# torch first, from the pinned constraints, so nothing pulls a CUDA build.
$(VENV)/.installed: pyproject.toml constraints/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints/ci.txt torch
	$(PIP) install -q -c constraints/ci.txt -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# FUSE backs the NFS-semantics test filesystem; as root we install it, elsewhere
# the FUSE tests skip with a reason (and fail loudly under CI=true).
system-deps:
	@if ! command -v fusermount3 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q fuse3 libfuse3-3 >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q fuse3 libfuse3-3 >/dev/null; }; \
	  else echo "fuse3 not installed and not root: FUSE tests will be skipped"; fi; \
	fi

demo: setup
	$(VENV)/bin/safeckpt demo --dir $(DEMO_DIR)

test: setup system-deps
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: setup system-deps
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

bench: setup
	$(PIP) install -q -c constraints/ci.txt -e '.[test,bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs
