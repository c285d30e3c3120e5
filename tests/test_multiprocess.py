"""Data parallelism: two processes (DDP over gloo, on the CPU) end where one process ends, and resume exactly.

scripts/check_two_process.py compares, with warmup + linear decay, AdamW and plain SGD: the learning rate and
grad norm logged at every step and the final weights. Planted and seen to fail it: the scheduler passed to
accelerate.prepare (rate 5e-4, 5e-4, 0 on two processes against 5e-4, 1e-3, 5e-4) and the loss not scaled by
the number of processes (grad norms halved; SGD weights 1.7e-2 apart)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_two_process.py"), "--steps", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "equivalent"
