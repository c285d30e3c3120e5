"""Two processes (on the CPU, gloo) end where one process ends, and resume exactly: data parallel (DDP) and
fully sharded (FSDP2).

scripts/check_two_process.py compares, with warmup + linear decay: the learning rate and grad norm logged at
every step and the final weights (and, per rank, the bytes of parameters, gradients and optimizer state).
Planted and seen to fail (DDP): the scheduler passed to accelerate.prepare (rate 5e-4, 5e-4, 0 on two processes
against 5e-4, 1e-3, 5e-4) and the loss not scaled by the number of processes (grad norms halved; SGD weights
1.7e-2 apart). Both runs use AdamW only here to keep the suite short (the script's default runs SGD too):
AdamW is the one whose resume needs the optimizer state; DDP under SGD runs in the dynamic-sampling test, and
the gradient scale SGD would see under FSDP is checked exactly by tests/test_sharding.py. The resume is
compared in the two plain checks (DDP and FSDP); the dynamic-sampling, mixture and two-machine checks skip it
(``--no-resume``: a launch fewer each). The checks share their one-process runs (``reference_cache``): the
DDP and FSDP checks train the same one, and so do the two mixture checks. Planted and seen to fail (FSDP): the resume not loading the sharded
optimizer state, the rollout without gathering the parameters (see tests/test_sharding.py), and gradients synchronised
on every micro-batch (reduce-scatters [5, 5] per step instead of [0, 9]: "gradients reduced once per step: NO").
The runs train with KL to a frozen reference, sharded under FSDP (its bytes are in the total)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LENGTH_TASK = ROOT / "tests" / "fixtures" / "answer_length_task.py"


@pytest.fixture(scope="module")
def reference_cache(tmp_path_factory):
    """One folder of one-process runs for the module's checks: the checks that train the same overrides (DDP and
    FSDP; the two mixture checks) train the one-process run once."""
    return tmp_path_factory.mktemp("one-process-runs")


def _check(reference_cache, *args: str) -> str:
    steps = [] if "--steps" in args else ["--steps", "3"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_two_process.py"), *steps, "--reference-cache", str(reference_cache), *args],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "equivalent"
    return done.stdout


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains(reference_cache):
    """DDP, AdamW (the optimizer whose resume needs its state); DDP under SGD, which sees a gradient scale AdamW
    hides in its weights (not in the grad norms this compares too), runs in the dynamic-sampling test below."""
    _check(reference_cache, "--strategy", "ddp", "--optimizers", "adamw")


@pytest.mark.slow
def test_two_sharded_processes_train_what_one_process_trains_with_half_the_memory_each(reference_cache):
    out = _check(reference_cache, "--strategy", "fsdp", "--optimizers", "adamw")
    total = next(line for line in out.splitlines() if line.strip().startswith("total"))
    assert total.count("(50.0%)") == 2, out  # each rank holds half of parameters + gradients + AdamW state + reference
    reference = next(line for line in out.splitlines() if line.strip().startswith("reference"))
    assert reference.count("(50.0%)") == 2, out
    assert "gradients reduced once per step (in the last micro-batch's backward only): yes" in out


@pytest.mark.slow
def test_two_processes_train_flat_grpo_with_dynamic_sampling_as_one_process_does(reference_cache):
    """Flat GRPO (each thought trained on its M rows) under DeepSeekMath's per-sequence normaliser, with dynamic
    sampling on a reward the untrained model's groups often score all alike (``long_answer``: steps 2 and 3
    draw 4 prompts again): SGD sees a wrong normaliser or a different choice of groups as a weight difference.
    Planted and seen to fail: the flat sequence weights divided by the process-local row count (weights 3.9e-2
    apart, grad norms doubled); each process deciding its draws and groups alone (weights 1.6e-2 apart, draws
    [0, 4, 4] against [0, 4, 0])."""
    out = _check(reference_cache, "--strategy", "ddp", "--optimizers", "sgd", "--no-resume", "--set", "data.task=long_answer", "algorithm.advantage_estimator=grpo",
                 "algorithm.answer_baseline=prompt", "algorithm.loss_aggregation=sequence", "algorithm.dynamic_sampling=true")  # fmt: skip
    drawn = next(line for line in out.splitlines() if "prompts drawn again" in line)
    assert drawn.split(": ", 1)[1].split(" / ")[0] != "[0, 0, 0]", drawn  # the draws were exercised


# ------------------------------------------------------------------------------- mixed data, several machines


@pytest.mark.slow
def test_sharded_processes_train_a_mixture_with_text_only_micro_batches_as_one_process_does(reference_cache):
    """Grounding scenes (images) + video clips + code (text-only prompts): at some steps one process's micro-batch
    has a video or an image while the other's has none, so the vision tower runs on one process only unless it always runs
    (prompts.idle_vision_term); 4 steps, SGD. Planted and seen to fail: the vision call skipped on a text-only
    micro-batch (gloo aborts: "Received data size doesn't match expected size"; see also tests/fsdp_parts.py
    variant mixed, which also makes one process's answers one token long)."""
    out = _check(reference_cache, "--strategy", "fsdp", "--optimizers", "sgd", "--steps", "4", "--mixture", "--no-resume")
    assert "micro-batches where the processes differ in what they hold (video, image, text): 0" not in out
    assert "micro-batches with a video: 0" not in out


@pytest.mark.slow
def test_two_machines_of_one_process_train_a_mixture_as_one_process_does(reference_cache):
    """The multi-node launch (accelerate's --num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1, one
    process each, gloo) on the mixture, DDP, SGD: the same code as one machine, the same result as one process
    (the one-process run the FSDP mixture check trained)."""
    out = _check(reference_cache, "--strategy", "ddp", "--optimizers", "sgd", "--steps", "4", "--mixture", "--machines", "2", "--no-resume")
    assert out.startswith("strategy: ddp; machines: 2")


# ------------------------------------------------------------------------------- a stop on one process


def _launch_two(run_dir, strategy, *overrides, env=None):
    """Two processes training the tiny untrained model (a Popen; stdout and stderr together)."""
    from conftest import TINY_RUN

    config = ROOT / "configs" / "accelerate" / ("cpu-2proc-fsdp.yaml" if strategy == "fsdp" else "cpu-2proc.yaml")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m", "vlm_grpo_ma.train",
        "--output-dir", str(run_dir), *TINY_RUN, "train.num_threads=1", f"data.task_modules=[{LENGTH_TASK}]", *overrides,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process, seconds):
    try:
        return process.communicate(timeout=seconds)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        subprocess.run(["pkill", "-9", "-f", "vlm_grpo_ma.train"], check=False)
        pytest.fail(f"the processes did not stop within {seconds} s (a process waiting on the other)")


@pytest.mark.slow
def test_a_non_finite_reward_on_one_sharded_process_stops_both_with_its_message_and_keeps_the_steps_done(
    untrained_tiny_dir, tmp_path
):
    """Rank 1's rewards turn infinite at step 2; rank 0's stay finite. Both processes stop at the same point,
    both print the message naming it, and (FSDP, whose checkpoint is collective) the step done is saved on
    the way out as one process saves it. Planted and seen to fail: the finiteness check left local (rank 1
    raised alone; rank 0 waited in the update's collectives until the test's deadline)."""
    run = tmp_path / "run"
    process = _launch_two(
        run, "fsdp", f"model.name_or_path={untrained_tiny_dir}", "data.task=infinite_on_rank_1", "train.steps=4",
        "train.checkpoint_every=100", env={"INFINITE_AFTER": str(run / "metrics.jsonl")},
    )  # fmt: skip
    output = _finish(process, 300)
    assert process.returncode != 0, output
    assert "error: step 2: reward is not finite" in output, output  # rank 1, its own error
    assert "error: process 1 stopped the run: NonFiniteError: step 2: reward is not finite" in output, output  # rank 0
    from vlm_grpo_ma.run.checkpoint import list_checkpoints

    assert [p.name for p in list_checkpoints(run)] == ["step-000001"], output


@pytest.mark.slow
def test_a_full_disk_on_the_main_sharded_process_mid_save_stops_both_with_its_message(untrained_tiny_dir, tmp_path):
    """The disk fills up on rank 0 while it writes the model folder of step 2's FSDP checkpoint. Both processes
    stop with its message within a minute, and checkpoint 1 stays whole and the newest. Planted and seen to fail:
    the whole collective save inside one survive.together block, as it was (rank 1 waited in the save's last
    barrier while rank 0 waited to agree, until the test's deadline). A shard failing inside dcp.save raises on
    every rank alike (tests/test_sharding.py::test_a_shard_that_fails_to_write_is_one_error_naming_the_process);
    launched here with FULL_DISK_WRITE=shard, FULL_DISK_RANK=1 it stopped both with "process 0 stopped the run:
    ShardedCheckpointError: writing ... failed on process 1: OSError: [Errno 28] No space left on device"."""
    run = tmp_path / "run"
    full_disk = ROOT / "tests" / "fixtures" / "full_disk.py"
    process = _launch_two(
        run, "fsdp", f"model.name_or_path={untrained_tiny_dir}", "data.task=answer_length", "train.steps=2",
        "train.checkpoint_every=1", f"data.task_modules=[{LENGTH_TASK}, {full_disk}]",
        env={"FULL_DISK_RANK": "0", "FULL_DISK_WRITE": "model", "FULL_DISK_AT_STEP": "2"},
    )  # fmt: skip
    output = _finish(process, 150)
    assert process.returncode != 0, output
    assert "OSError: [Errno 28] No space left on device" in output, output  # rank 0's own (rank 1 says nothing)
    from vlm_grpo_ma.run.checkpoint import list_checkpoints, load_resumable_state

    assert [p.name for p in list_checkpoints(run)] == ["step-000001"], output
    assert load_resumable_state(run / "checkpoints" / "step-000001")["step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_to_one_process_stops_both_saves_the_steps_done_and_resume_continues(untrained_tiny_dir, tmp_path, strategy):
    """SIGTERM to rank 1 only (a scheduler, a dying node): both processes stop after their current phase, the
    steps done are checkpointed (FSDP too), and --resume then trains to the end. Planted and seen to fail:
    SIGTERM raised where it lands (rank 1 stopped alone; FSDP saved nothing and rank 0 hung)."""
    run = tmp_path / "run"
    overrides = [f"model.name_or_path={untrained_tiny_dir}", "data.task=answer_length", "train.steps=40", "train.checkpoint_every=100"]
    process = _launch_two(run, strategy, *overrides)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert process.poll() is None, process.stdout.read()
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("no two steps within 240 s")
        time.sleep(0.2)
    os.kill(_worker_pid(process.pid, rank=1), signal.SIGTERM)
    output = _finish(process, 180)
    # Both processes stop at the same point (each logs it) and exit 143; the launcher exits 1. When the first
    # exits, torchrun's agent sends the other SIGTERM, which may land after the checkpoint and before its own
    # exit: the launcher's summary then shows -15 for it.
    assert process.returncode != 0 and re.search(r"exitcode\s+:\s*143", output), output
    assert output.count("stopping every process: process 1 received signal SIGTERM") == 2, output
    assert output.count(f"Continue with: python -m vlm_grpo_ma.train --output-dir {run} --resume") == 1, output
    assert output.count("INFO vlm_grpo_ma.train: trainable:") == 1, output  # INFO from the main process only
    from vlm_grpo_ma.run.checkpoint import latest_checkpoint

    last_logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert latest_checkpoint(run).name == f"step-{last_logged:06d}", output  # nothing done was lost
    resumed = _launch_two(run, strategy, *overrides[:-2], f"train.steps={last_logged + 1}", "--resume")
    output = _finish(resumed, 240)
    assert resumed.returncode == 0, output
    assert output.count("INFO vlm_grpo_ma.train: resumed from") == 1, output
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, last_logged + 2))


@pytest.mark.slow
def test_a_folder_that_holds_a_run_or_is_locked_is_refused_in_one_line_once(tmp_path):
    """Under a launch every process refused a folder holding a run and printed the line (two copies, glued
    together), and one process aborted ("terminate called without an active exception"); a locked folder was
    said four times (each process's "stopping every process" log, the main process's error and the other's
    "process 0 stopped the run"). The processes now stop together at the check, and the main process says it.
    Planted and seen to fail: every process printing its error (each line twice)."""
    from vlm_grpo_ma.run.run_dir import LOCK_FILE, hold_run_dir

    held = tmp_path / "held"
    held.mkdir()
    (held / "metrics.jsonl").write_text("")
    output = _finish(_launch_two(held, "ddp"), 120)
    assert [line for line in output.splitlines() if "already holds a run" in line] == [
        f"error: train.output_dir={held} already holds a run (metrics.jsonl); continue it with --resume, start over"
        " with --overwrite (deletes those outputs), or choose another --output-dir"
    ], output
    assert "terminate called" not in output, output
    locked = tmp_path / "locked"
    locked.mkdir()
    lock = hold_run_dir(locked)  # another run's, alive
    try:
        output = _finish(_launch_two(locked, "ddp"), 120)
    finally:
        lock.close()
    holder = (locked / LOCK_FILE).read_text().strip()
    assert [line for line in output.splitlines() if "is in use by another run" in line] == [
        f"error: train.output_dir={locked} is in use by another run ({holder}); wait for it to end, stop it, or choose"
        " another --output-dir"
    ], output


def _worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the training process of ``rank`` under an ``accelerate launch`` (its RANK environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"vlm_grpo_ma.train" in command and b"accelerate" not in command:
            if _descends_from(int(entry.name), launcher_pid):
                return int(entry.name)
    raise AssertionError(f"no training process of rank {rank} under pid {launcher_pid}")


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        pid = int(fields[1])  # the parent's pid
    return False
