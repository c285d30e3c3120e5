"""Two processes (on the CPU, gloo) end where one process ends, and resume exactly: data parallel (DDP) and
fully sharded (FSDP2).

scripts/check_two_process.py compares, with warmup + linear decay: the learning rate and grad norm logged at
every step and the final weights (and, per rank, the bytes of parameters, gradients and optimizer state).
Planted and seen to fail (DDP): the scheduler passed to accelerate.prepare (rate 5e-4, 5e-4, 0 on two processes
against 5e-4, 1e-3, 5e-4) and the loss not scaled by the number of processes (grad norms halved; SGD weights
1.7e-2 apart). FSDP runs AdamW only here to keep the suite short (the script's default runs SGD too; the
gradient scale SGD would see is checked exactly by tests/test_sharding.py); AdamW is the one whose resume
needs the optimizer state. Planted and seen to fail (FSDP): the resume not loading the sharded optimizer
state, the rollout without gathering the parameters (see tests/test_sharding.py), and gradients synchronised
on every micro-batch (reduce-scatters [5, 5] per step instead of [0, 9]: "gradients reduced once per step: NO").
The runs train with KL to a frozen reference, sharded under FSDP (its bytes are in the total)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_two_process.py"), "--steps", "3", *args],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "equivalent"
    return done.stdout


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains():
    _check("--strategy", "ddp")


@pytest.mark.slow
def test_two_sharded_processes_train_what_one_process_trains_with_half_the_memory_each():
    out = _check("--strategy", "fsdp", "--optimizers", "adamw")
    total = next(line for line in out.splitlines() if line.strip().startswith("total"))
    assert total.count("(50.0%)") == 2, out  # each rank holds half of parameters + gradients + AdamW state + reference
    reference = next(line for line in out.splitlines() if line.strip().startswith("reference"))
    assert reference.count("(50.0%)") == 2, out
    assert "gradients reduced once per step (in the last micro-batch's backward only): yes" in out


@pytest.mark.slow
def test_two_processes_train_flat_grpo_with_dynamic_sampling_as_one_process_does():
    """Flat GRPO (each thought trained on its M rows) under DeepSeekMath's per-sequence normaliser, with dynamic
    sampling on a reward the untrained model's groups often score all alike (``long_answer``: steps 2 and 3
    draw 4 prompts again): SGD sees a wrong normaliser or a different choice of groups as a weight difference.
    Planted and seen to fail: the flat sequence weights divided by the process-local row count (weights 3.9e-2
    apart, grad norms doubled); each process deciding its draws and groups alone (weights 1.6e-2 apart, draws
    [0, 4, 4] against [0, 4, 0])."""
    out = _check("--strategy", "ddp", "--optimizers", "sgd", "--set", "data.task=long_answer", "algorithm.advantage_estimator=grpo",
                 "algorithm.answer_baseline=prompt", "algorithm.loss_aggregation=sequence", "algorithm.dynamic_sampling=true")  # fmt: skip
    drawn = next(line for line in out.splitlines() if "prompts drawn again" in line)
    assert drawn.split(": ", 1)[1].split(" / ")[0] != "[0, 0, 0]", drawn  # the draws were exercised
