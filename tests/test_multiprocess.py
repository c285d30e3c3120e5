"""Data parallelism: two processes (DDP over gloo, on the CPU) end where one process ends, and resume exactly."""

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
