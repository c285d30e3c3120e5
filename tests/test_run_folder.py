"""Nothing lost in a run folder (issue 34's first items): one run holds a folder for its life, a resume touches
nothing in a folder no run of this trainer wrote, pruning never deletes the checkpoints a resume fell back to,
and evaluate falls back from a checkpoint whose weights are cut short instead of a raw SafetensorError."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import TINY_RUN

from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run import cli
from vlm_grpo_ma.run.config import Config
from vlm_grpo_ma.run.config_files import save_config
from vlm_grpo_ma.tools import evaluate


def _files(folder):
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture
def held_by_another_process(tmp_path):
    """A process that holds ``tmp_path / 'run'`` as a live run does, until the test ends."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    save_config(Config(), run / "config.yaml")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from vlm_grpo_ma.run.run_dir import hold_run_dir; "
         "lock = hold_run_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)", str(run)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    yield run, holder.pid
    holder.kill()
    holder.wait()


def test_a_second_run_on_a_live_runs_folder_is_refused_naming_the_holder(held_by_another_process, untrained_tiny_dir, capsys):
    """Two runs on one folder both ran (metrics steps [1, 2, 1, 3, 2, 3]); --overwrite deleted a live run's
    outputs. Planted: no lock taken; the second run started, and --overwrite deleted metrics.jsonl."""
    run, pid = held_by_another_process
    before = _files(run)
    fresh = [f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN, "train.steps=1"]
    for extra in (fresh, [*fresh, "--overwrite"], ["--resume"]):
        code = cli.main(["--output-dir", str(run), *extra])
        assert code == 2, extra
        message = capsys.readouterr().err
        assert f"is in use by another run (pid {pid} on " in message and "--output-dir" in message, message
        assert _files(run) == before


def test_the_lock_goes_with_the_run(tmp_path, untrained_tiny_dir, monkeypatch):
    """A run that ended or crashed leaves the folder free, even while its traceback (which holds the run's
    frames) is still alive: the same process resumes at once. Planted: the lock left to garbage collection, in
    the loop and in setup; the resume after each crash was refused as 'in use by another run'."""
    from vlm_grpo_ma.run import loop, setup

    run = tmp_path / "run"
    assert cli.main(["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN, "train.steps=1"]) == 0
    for module, name in ((loop, "update_policy"), (setup, "make_engine")):  # a crash mid-run, one during setup

        def crash(*args, **kwargs):
            raise RuntimeError("a crash")

        monkeypatch.setattr(module, name, crash)
        with pytest.raises(RuntimeError, match="a crash") as crashed:
            cli.main(["--output-dir", str(run), "--resume", "train.steps=2"])
        monkeypatch.undo()
        assert crashed.traceback  # still alive here
        assert cli.main(["--output-dir", str(run), "--resume", "train.steps=2"]) == 0, name


def test_a_resume_touches_nothing_in_a_folder_no_run_of_ours_wrote(tmp_path, untrained_tiny_dir, capsys):
    """``--resume`` on another tool's folder emptied its metrics.jsonl and rewrote its config. Planted: the
    resume let through without a config.yaml; metrics.jsonl was emptied."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    before = _files(other)
    assert cli.main(["--output-dir", str(other), "--resume", f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN]) == 2
    assert "holds metrics.jsonl but no config.yaml of a run of this trainer" in capsys.readouterr().err
    assert _files(other) == before
    (other / "config.yaml").write_text("optimizer: {lr: 0.1}\n")  # another tool's config
    before = _files(other)
    assert cli.main(["--output-dir", str(other), "--resume", *TINY_RUN]) == 2
    assert "unknown config section 'optimizer'" in capsys.readouterr().err
    assert _files(other) == before


def _write(folder):
    folder.mkdir()
    (folder / "weights.txt").write_text("w")


def test_pruning_keeps_what_a_resume_fell_back_to(tmp_path):
    """A resume passed over a corrupt step-4 and went on from step 2; the next save's pruning counted step-4 as
    the newest and, keeping 1, deleted step-2 and the step-3 it had just written. Planted: the old pruning
    (every checkpoint counted); step-3 was gone."""
    ckpt.save_checkpoint(tmp_path, 2, write_model=_write, training_state={}, keep=2)
    ckpt.save_checkpoint(tmp_path, 4, write_model=_write, training_state={}, keep=2)
    (ckpt.checkpoint_dir(tmp_path, 4) / "state.pt").write_bytes(b"cut sh")  # does not load
    ckpt.save_checkpoint(tmp_path, 3, write_model=_write, training_state={}, keep=1)
    assert [c.name for c in ckpt.list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    assert ckpt.load_resumable_state(ckpt.checkpoint_dir(tmp_path, 3))["step"] == 3
    ckpt.save_checkpoint(tmp_path, 4, write_model=_write, training_state={}, keep=1)  # reached again: replaced
    assert [c.name for c in ckpt.list_checkpoints(tmp_path)] == ["step-000004"]


def test_evaluate_falls_back_from_cut_weights_and_names_them(tmp_path, untrained_tiny_dir, capsys):
    """evaluate on a run whose newest model.safetensors is cut short raised a raw SafetensorError. Planted: the
    newest checkpoint taken unchecked; the error came from safetensors at load."""
    run = tmp_path / "run"
    base = ["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN, "train.checkpoint_every=1"]
    assert cli.main([*base, "train.steps=2"]) == 0
    weights = ckpt.checkpoint_dir(run, 2) / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert evaluate.resolve_model(str(run)).label == "run@step-000001"
    with pytest.raises(ValueError, match=r"model.safetensors does not load \(SafetensorError"):
        evaluate.resolve_model(str(ckpt.checkpoint_dir(run, 2)))
    capsys.readouterr()
    assert evaluate.main(["--models", str(ckpt.checkpoint_dir(run, 2)), "--output-dir", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "model.safetensors does not load" in err
    assert torch.load(ckpt.checkpoint_dir(run, 1) / "state.pt", weights_only=False)["step"] == 1



def test_a_process_that_does_not_see_the_main_processs_folder_is_refused(tmp_path):
    """Processes on machines without a shared train.output_dir each chose their own checkpoint and whether to
    save on the way out, and drifted or hung. Every process now compares the lock it sees with the main
    process's. Planted: the comparison skipped; a process with another folder passed."""
    from vlm_grpo_ma.run.config import ConfigError
    from vlm_grpo_ma.run.run_dir import LOCK_FILE, check_shared_folder

    (tmp_path / LOCK_FILE).write_text("pid 1 on host-a since 2026-12-06T08:00:00Z: train\n")
    check_shared_folder(tmp_path, "pid 1 on host-a since 2026-12-06T08:00:00Z: train\n")
    with pytest.raises(ConfigError, match=r"is not the folder the main process writes .* this process sees 'pid 2 on host-b"):
        (tmp_path / LOCK_FILE).write_text("pid 2 on host-b since 2026-12-06T08:00:01Z: train\n")
        check_shared_folder(tmp_path, "pid 1 on host-a since 2026-12-06T08:00:00Z: train\n")
    (tmp_path / LOCK_FILE).unlink()
    with pytest.raises(ConfigError, match="this process sees 'no lock'"):
        check_shared_folder(tmp_path, "pid 1 on host-a since 2026-12-06T08:00:00Z: train\n")
