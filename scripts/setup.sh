#!/usr/bin/env bash
# Create .venv inside the checkout (once) and install the project with its test tools.
# torch and torchvision are pinned as a pair (see docs/ARCHITECTURE.md, "Installing"); on a GPU machine
# install the torch build you want first, then `pip install -e .[gpu,dev]`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import vlm_grpo_ma, torch, torchvision, transformers, pytest" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q "torch==2.14.1" "torchvision==0.29.1" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import vlm_grpo_ma, torch, torchvision, transformers, pytest"
fi
