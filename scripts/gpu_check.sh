#!/usr/bin/env bash
# GPU check: a few GRPO-MA T4A4 steps of a random-weight Qwen2.5-VL-3B-sized model, then a one-screen summary
# (attention, step time, generated / trained tokens per second, peak GPU memory, wall time).
#   scripts/gpu_check.sh                                   # 3B-sized, 5 steps, on the GPU (one H200: ~5 min)
#   scripts/gpu_check.sh --lora                            # the LoRA preset's settings
#   scripts/gpu_check.sh --size tiny --device cpu --steps 2  # check the script itself on a CPU (< 1 min)
# All arguments go to scripts/gpu_check.py (--help lists them). Uses .venv/bin/python when the checkout has
# one, else $PYTHON, else python3; the checkout itself is put on PYTHONPATH, so no install is needed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ -x "$root/.venv/bin/python" ]; then
  python="$root/.venv/bin/python"
else
  python="${PYTHON:-python3}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" "$root/scripts/gpu_check.py" "$@"
