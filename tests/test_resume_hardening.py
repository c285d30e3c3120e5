"""A resume that quietly becomes another run, and the run folder's last tracebacks (issue 45). Each test names
the bug planted to see it fail."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN

from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run import cli
from vlm_grpo_ma.run import loop as train_module
from vlm_grpo_ma.run.config import ConfigError
from vlm_grpo_ma.run.config_files import load_config, save_config
from vlm_grpo_ma.run.run_dir import LOCK_FILE, hold_run_dir

LENGTH_TASK = str(Path(__file__).parent / "fixtures" / "answer_length_task.py")


def _files(folder):
    """Every file of ``folder`` and its bytes, but the lock (stamped by any run that reaches setup)."""
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file() and path.name != LOCK_FILE}


def _one_line_error(capsys) -> str:
    """The error line the command printed last (a model's load may have drawn its progress bar before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1] + "\n"
    assert last.startswith("error: ") and err.endswith(last), err
    return last


def _run(tmp_path, model_dir, *extra, name="run"):
    run = tmp_path / name
    assert cli.main(["--output-dir", str(run), f"model.name_or_path={model_dir}", *TINY_RUN, *extra]) == 0
    return run


def test_config_yaml_is_replaced_whole_never_cut_short(tmp_path, monkeypatch):
    """config.yaml was written in place: a crash mid-write left it cut short or empty, and a resume filled in
    the defaults. Planted: path.write_text again, which writes in place and never syncs: the failure below did
    not come (DID NOT RAISE), nothing kept the old file whole."""
    path = tmp_path / "config.yaml"
    save_config(load_config(None, ["rollout.num_thoughts=2"]), path)
    before = path.read_text()

    def disk_full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # the write fails before the new file is whole on disk
    with pytest.raises(OSError, match="No space left"):
        save_config(load_config(None, ["rollout.num_thoughts=3"]), path)
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    monkeypatch.undo()
    save_config(load_config(None, ["rollout.num_thoughts=3"]), path)
    assert load_config(path).rollout.num_thoughts == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_resume_refuses_an_empty_or_cut_config_yaml_naming_what_is_missing(tmp_path, untrained_tiny_dir, capsys):
    """An empty or cut config.yaml resumed a K=2, M=2 run of 2 prompts as 4 x 4 with 16 (the defaults filled in).
    Planted: no check of the saved config; both resumes below went on (exit 0)."""
    run = _run(tmp_path, untrained_tiny_dir, "train.steps=1")
    config = run / "config.yaml"
    whole = config.read_text()
    capsys.readouterr()
    config.write_text("# resumed 2026-01-01T00:00:00Z at step 1: no setting changed\n")
    before = _files(run)
    assert cli.main(["--output-dir", str(run), "--resume", "train.steps=1"]) == 2
    assert f"error: --resume: the run's own {config}: config.yaml is empty (cut short?)" in _one_line_error(capsys)
    lines = whole.splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if line.strip().startswith("num_answers:"))
    config.write_text("".join(lines[:cut]))  # a crash mid-write, at a line's end: valid YAML
    assert _files(run) == {**before, config: config.read_bytes()}
    assert cli.main(["--output-dir", str(run), "--resume", "train.steps=1"]) == 2
    message = _one_line_error(capsys)
    assert "config.yaml lacks algorithm.*, data.*, train.*, logging.*, rollout.num_answers, rollout.max_thought_tokens," in message
    assert " more (cut short, or edited)" in message


def test_a_dict_given_whole_replaces_the_saved_one_and_an_entry_sets_one(tmp_path):
    """A resume merged the command line's data.tasks into the saved one: a task could be added, never removed.
    Planted: the old merge (mapping into mapping); tasks kept answer_length."""
    saved = tmp_path / "config.yaml"
    save_config(load_config(None, ["data.tasks={grounding: 1, answer_length: 2}", "data.reward_weights={iou: 2, format: 1}"]), saved)
    cfg = load_config(None, ["data.tasks={grounding: 1}", "data.reward_weights.format=0"], base=saved)
    assert cfg.data.tasks == {"grounding": 1.0} and cfg.data.reward_weights == {"iou": 2.0, "format": 0.0}
    other = tmp_path / "other.yaml"
    other.write_text("data:\n  tasks: {vqa: 1}\n")  # a file names the dict whole too
    assert load_config(other, base=saved).data.tasks == {"vqa": 1.0}


def test_a_resume_that_changes_what_the_checkpoint_holds_is_refused_naming_the_key(tmp_path, untrained_tiny_dir, capsys):
    """Changed LoRA targets were written into config.yaml while the adapter kept its old ones, freeze_vision
    ended in a raw traceback, optimizer=sgd in KeyError 'momentum' at the first update, a reward weight change
    was logged at INFO only, and a task could not be removed. Planted: the old hand-kept RUN_DEFINING_KEYS; the
    lora_target_modules resume went on (exit 0) and the rest of the test was not reached. Planted: train.seed
    shaping the data part (changeable with --allow-changes, half applied: the stream kept the saved seed); this failed."""
    run = _run(tmp_path, untrained_tiny_dir, "train.steps=1", "model.lora_rank=2", f"data.task_modules=[{LENGTH_TASK}]",
               "data.tasks={grounding: 1, answer_length: 1}")  # fmt: skip
    capsys.readouterr()
    before = _files(run)
    resume = ["--output-dir", str(run), "--resume", "train.steps=2"]
    changes = {
        "model.lora_target_modules=[q_proj]": "model.lora_target_modules=['q_proj'] (the run has ['q_proj', 'k_proj',",
        "model.freeze_vision=false": "model.freeze_vision=False (the run has True), which shapes which parameters train",
        "train.optimizer=sgd": "train.optimizer='sgd' (the run has 'adamw'), which shapes the optimizer's state",
        "train.seed=5": "train.seed=5 (the run has 0), which shapes the run's random streams",
        "data.reward_weights={length: 2}": "data.reward_weights={'length': 2.0} (the run has {}), which shapes the objective",
        "data.tasks={grounding: 1}": "data.tasks={'grounding': 1.0} (the run has {'grounding': 1.0, 'answer_length': 1.0})",
    }
    for i, (change, named) in enumerate(changes.items()):
        for allowed in ([], ["--allow-changes"]) if i < 4 else ([],):
            assert cli.main([*resume, *allowed, change]) == 2, change
            message = _one_line_error(capsys)
            assert named in message, message
            if i < 4:  # the checkpoint holds them as saved: no change could take effect, allowed or not
                assert message.startswith(f"error: --resume cannot change {named}") and "could not take effect" in message
            else:
                assert "this command changes what the run is" in message and "add --allow-changes" in message
    assert cli.main([*resume, "--allow-changes", "data.tasks={grounding: 1}"]) == 2  # the data stream cannot carry over
    assert "The data position cannot carry over to other data" in _one_line_error(capsys)
    assert _files(run) == before
    assert cli.main([*resume, "--allow-changes", "data.reward_weights={length: 2}"]) == 0  # the objective can change
    assert load_config(run / "config.yaml").data.reward_weights == {"length": 2.0}
    assert "data.reward_weights: {} -> {'length': 2.0}" in (run / "config.yaml").read_text().splitlines()[0]


def test_a_resumed_run_uses_the_learning_rate_and_schedule_it_is_given(tmp_path, untrained_tiny_dir):
    """torch put the checkpoint's learning rate back with the optimizer's state, and the scheduler its base rate
    and its last rate: a resume that set train.learning_rate=1e-3 and extended a linear schedule trained step 2
    at 0 (the old 1-step schedule's end). Planted: the settings not put back over the loaded ones; step 2 logged 0."""
    run = _run(tmp_path, untrained_tiny_dir, "train.steps=1", "train.lr_schedule=linear")
    assert cli.main(["--output-dir", str(run), "--resume", "train.steps=2", "train.learning_rate=1e-3"]) == 0
    rates = [json.loads(line)["train/learning_rate"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rates == [2e-4, 1e-3 * (1 - 1 / 2)]  # linear over 2 steps: factor 1 - s / 2 at step index s


def test_a_corrupt_checkpoint_is_set_aside_so_a_stop_before_the_next_save_saves(tmp_path, untrained_tiny_dir, monkeypatch):
    """A resume passed over a corrupt step-2 and left it in place; stopped after step 2 again, before the next
    save, the run took step-2 as saved already, and the next resume lost the step. Planted: no setting aside;
    step-2 stayed the corrupt one."""
    run = _run(tmp_path, untrained_tiny_dir, "train.steps=2", "train.checkpoint_every=1")
    state = ckpt.checkpoint_dir(run, 2) / "state.pt"
    os.truncate(state, state.stat().st_size // 2)
    real_sample_step = train_module.sample_step

    def stop_in_step_3(run_state, step):
        if step == 2:
            raise KeyboardInterrupt  # Ctrl-C
        return real_sample_step(run_state, step)

    monkeypatch.setattr(train_module, "sample_step", stop_in_step_3)
    assert cli.main(["--output-dir", str(run), "--resume", "train.steps=3", "train.checkpoint_every=5"]) == 130
    assert [c.name for c in ckpt.list_checkpoints(run)] == ["step-000001", "step-000002"]
    assert ckpt.load_resumable_state(ckpt.checkpoint_dir(run, 2))["step"] == 2  # saved on the way out
    with pytest.raises(ckpt.CheckpointLoadError):  # kept for a look, under a name no checkpoint has
        ckpt.load_resumable_state(run / "checkpoints" / "step-000002.corrupt")


def test_a_lock_that_is_a_folder_a_link_or_unwritable_is_one_line(tmp_path, monkeypatch):
    """A .run.lock folder and a read-only run folder raised IsADirectoryError / PermissionError; a .run.lock
    link was followed and its target overwritten. Planted: the old open(..., "a+"); a raw OSError, and the
    link's target emptied."""
    (tmp_path / "a" / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"^train.output_dir={tmp_path / 'a'}: cannot write its lock .*\(Is a directory\)"):
        hold_run_dir(tmp_path / "a")
    (tmp_path / "b").mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (tmp_path / "b" / LOCK_FILE).symlink_to(target)
    with pytest.raises(ConfigError, match=rf"its {LOCK_FILE} is a symbolic link \(to {target}\)"):
        hold_run_dir(tmp_path / "b")
    assert target.read_text() == "keep me\n"
    (tmp_path / "c").mkdir()
    real_open = os.open

    def read_only(path, *args, **kwargs):  # this test runs as root, whom a read-only folder does not stop
        if Path(path).parent == tmp_path / "c":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match=r"cannot write its lock .*\(Permission denied\); a run needs a folder it can write"):
        hold_run_dir(tmp_path / "c")
    monkeypatch.undo()
    hold_run_dir(tmp_path / "c").close()


def test_a_lock_that_is_a_fifo_is_one_line(tmp_path):
    """A FIFO .run.lock opened, then io.UnsupportedOperation at its seek. Planted: the plain-file check removed;
    that traceback."""
    (tmp_path / "f").mkdir()
    os.mkfifo(tmp_path / "f" / LOCK_FILE)
    with pytest.raises(ConfigError, match=rf"^train.output_dir={tmp_path / 'f'}: its {LOCK_FILE} is not a plain file"):
        hold_run_dir(tmp_path / "f")


def test_an_output_dir_the_os_refuses_is_one_line_naming_it_and_the_reason(tmp_path, untrained_tiny_dir, capsys, monkeypatch):
    """A folder name too long (even to look at), one under /proc, and one whose parent is not writable raised
    OSError, FileNotFoundError and PermissionError tracebacks. Planted: the except around the folder's checks
    and mkdir removed; each of those tracebacks."""
    long_name = tmp_path / ("a" * 300) / "sub"
    unwritable = tmp_path / "ro" / "sub"
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):  # this test runs as root, whom a read-only folder does not stop
        if Path(path).parent == tmp_path / "ro":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    cases = [(long_name, "File name too long"), (Path("/proc/self/h11-run"), "No such file or directory"), (unwritable, "Permission denied")]
    for run, reason in cases:
        assert cli.main(["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN]) == 2
        assert _one_line_error(capsys) == f"error: train.output_dir={run}: cannot create or read it ({reason}); choose another --output-dir\n"


def test_a_run_folder_whose_config_cannot_be_written_is_one_line(tmp_path, untrained_tiny_dir, capsys, monkeypatch):
    """The lock written (it was there already), but not the .config.yaml.tmp beside it: a PermissionError
    traceback from write_atomically. Planted: the except around save_config removed; that traceback."""
    from vlm_grpo_ma.run import config_files

    run = tmp_path / "run"

    def read_only(path, *args, **kwargs):  # the folder refuses new files (root is not stopped by its mode)
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(config_files, "open", read_only, raising=False)  # write_atomically's open
    assert cli.main(["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN]) == 2
    assert _one_line_error(capsys) == f"error: train.output_dir={run}: cannot write its config.yaml (Permission denied); choose another --output-dir\n"


def test_an_output_dir_under_a_file_is_one_line(tmp_path, untrained_tiny_dir, capsys):
    """``--output-dir some_file/run`` raised NotADirectoryError. Planted: the check removed; the traceback."""
    (tmp_path / "some_file").write_text("x")
    run = tmp_path / "some_file" / "run"
    assert cli.main(["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN]) == 2
    assert _one_line_error(capsys) == (
        f"error: train.output_dir={run} is under {tmp_path / 'some_file'}, a file, not a folder; choose another --output-dir\n"
    )


def test_a_video_budget_below_the_models_vision_token_is_refused_once_the_model_is_known(tiny_qwen3_5_dir):
    """config.validate refuses budgets below 28 x 28 (the smallest token of the families the trainer runs); a
    model of 32 x 32-pixel tokens (Qwen3.5) failed at the first video with 784 .. 1023. Planted: the setup check
    removed; the policy loaded."""
    from vlm_grpo_ma.run.setup import load_training_policy

    cfg = load_config(None, [f"model.name_or_path={tiny_qwen3_5_dir}", "model.video_max_pixels=1000"])
    with pytest.raises(ConfigError, match=r"^model.video_max_pixels=1000 must be >= 1024, one vision token \(32x32 pixels on "):
        load_training_policy(cfg, None, torch.device("cpu"))
    assert load_config(None, ["model.video_max_pixels=784"]).model.video_max_pixels == 784  # 28 x 28 passes validate
