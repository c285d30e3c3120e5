"""A new user's first hour (issue 35): a resume continues the run's own settings, a run without learning signal
says so, a mistyped model path fails at once in one line, default folders follow the task and the model."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import TINY_RUN

from vlm_grpo_ma.run import cli
from vlm_grpo_ma.run.config_files import load_config
from vlm_grpo_ma.run.loop import train
from vlm_grpo_ma.run.metrics import read_metrics


def _files(folder):
    """Every file of ``folder`` and its bytes, but the lock: a run that reaches setup stamps it with its pid and
    start (run_dir.hold_run_dir), by design, before a later refusal."""
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file() and path.name != ".run.lock"}


@pytest.fixture
def short_run(untrained_tiny_dir, tmp_path):
    """A one-step run of 2 prompts with a held-out evaluation of 3 samples: settings far from the defaults."""
    run = tmp_path / "run"
    code = cli.main(["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", *TINY_RUN, "train.steps=1",
                     "train.eval_every=1", "train.eval_samples=3"])  # fmt: skip
    assert code == 0
    return run


def test_a_resume_continues_with_the_runs_own_settings(short_run, untrained_tiny_dir, capsys):
    """``--resume train.steps=2`` went on at the defaults (16 prompts, 100 held-out samples, the embedded
    model) and overwrote config.yaml. Planted: the command line's settings used as they are; this failed."""
    assert cli.main(["--output-dir", str(short_run), "--resume", "train.steps=2"]) == 0
    cfg = load_config(short_run / "config.yaml")
    assert (cfg.train.steps, cfg.train.prompts_per_step, cfg.train.eval_samples) == (2, 2, 3)
    assert cfg.model.name_or_path == str(untrained_tiny_dir) and cfg.rollout.num_thoughts == 2
    first = (short_run / "config.yaml").read_text().splitlines()[0]
    assert first.startswith("# resumed 20") and first.endswith(" at step 1: train.steps: 1 -> 2")
    rows = read_metrics(short_run)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["eval/grounding/prompts"] == 3
    assert cli.main(["--output-dir", str(short_run), "--resume", "train.steps=3"]) == 0  # a second resume: two lines
    history = [line for line in (short_run / "config.yaml").read_text().splitlines() if line.startswith("# ")]
    assert len(history) == 2 and history[1].endswith(" at step 2: train.steps: 2 -> 3")


def test_a_resume_that_changes_what_the_run_is_is_refused_and_touches_nothing(short_run, capsys):
    """Resuming with another task ended in a raw traceback. Planted: data.task left out of the run-defining
    keys; the message named no key (the resume went on until the data stream refused it)."""
    before = _files(short_run)
    assert cli.main(["--output-dir", str(short_run), "--resume", "--task", "math", "train.steps=2"]) == 2
    message = capsys.readouterr().err
    assert "data.task='math' (the run has 'grounding')" in message and "--allow-changes" in message
    assert message.count("\n") == 1  # one line, no traceback
    assert _files(short_run) == before
    # allowed, the data position cannot carry over: a message, still no traceback, nothing written
    assert cli.main(["--output-dir", str(short_run), "--resume", "--task", "math", "--allow-changes", "train.steps=2"]) == 2
    message = capsys.readouterr().err
    assert "The data position cannot carry over to other data" in message and "model.name_or_path=" in message
    assert _files(short_run) == before
    assert cli.main(["--output-dir", str(short_run), "--allow-changes"]) == 2  # without --resume: nothing to allow
    assert "--allow-changes goes with --resume" in capsys.readouterr().err


def test_an_allowed_change_is_logged_and_recorded(short_run, caplog):
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.train"):
        assert cli.main(["--output-dir", str(short_run), "--resume", "--allow-changes", "algorithm.scale_by_std=false", "train.steps=2"]) == 0
    assert "--resume changes algorithm.scale_by_std: True -> False" in caplog.text
    first = (short_run / "config.yaml").read_text().splitlines()[0]
    assert first.endswith("at step 1: algorithm.scale_by_std: True -> False; train.steps: 1 -> 2")
    assert load_config(short_run / "config.yaml").algorithm.scale_by_std is False


def test_a_run_without_learning_signal_says_so(untrained_tiny_dir, tmp_path, caplog, capsys):
    """The untrained model never writes a math answer: every reward is 0, every advantage 0. Planted: the
    warning removed; the test failed. The control (answer_length rewards that vary) must not warn."""
    cfg = load_config(None, [f"model.name_or_path={untrained_tiny_dir}", f"train.output_dir={tmp_path / 'math'}", *TINY_RUN,
                             "data.task=math", "train.steps=3"])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.train"):
        summary = train(cfg)
    assert ("no learning signal: all 2 groups had equal rewards in each of the last 3 steps, so every advantage is 0 and"
            " nothing trains; the model may not solve this task yet: see docs/TASKS.md") in caplog.text
    # planted: no command; failed. Planted: no word of the target math lacks (the warm start refuses it); failed
    warm_start = ("or warm-start it on its data: python -m vlm_grpo_ma.warmstart --task math (first give math a Task.target,"
                  " the completion to imitate)\n")
    assert warm_start in caplog.text
    assert summary["counters"]["steps_without_signal"] == 3 and summary["counters"]["groups_without_signal"] == 6
    assert read_metrics(tmp_path / "math")[-1]["count/steps_without_signal"] == 3
    printed = capsys.readouterr().out
    assert "no learning signal in 3 of 3 steps" in printed and warm_start in printed
    assert json.loads((tmp_path / "math" / "summary.json").read_text())["counters"]["steps_without_signal"] == 3

    from test_objectives import LENGTH_TASK

    caplog.clear()
    cfg = load_config(None, [f"model.name_or_path={untrained_tiny_dir}", f"train.output_dir={tmp_path / 'length'}", *TINY_RUN,
                             "data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]", "train.steps=3"])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.train"):
        summary = train(cfg)
    assert "no learning signal" not in caplog.text and summary["counters"]["steps_without_signal"] == 0
    assert "no learning signal" not in capsys.readouterr().out


@pytest.mark.parametrize("path", ["runs/nope", "./nope", "some/hub-id-that-is-not-cached"])
def test_a_mistyped_model_path_fails_at_once_in_one_line(path, tmp_path, monkeypatch, capsys):
    """``model.name_or_path=runs/nope`` retried the hub for 34 s and printed two tracebacks. Planted: the one-slash
    path treated as a hub id and passed on; transformers' errors came instead (and no run folder is made).
    "At once" is each command's own check of the path refusing it before any data, model or folder is touched
    (the key it names says which check), not a wall-clock limit that a loaded machine can miss (issue 45).
    Planted: evaluate without its check of --models (the refusal came later, from loading, naming
    model.name_or_path)."""
    from vlm_grpo_ma.tools import evaluate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert cli.main([f"model.name_or_path={path}"]) == 2
    assert evaluate.main(["--models", path]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") and repr(path) in line and "no such local folder" in line for line in err)
    assert err[0].startswith("error: model.name_or_path ") and err[1].startswith("error: --models ")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []


def test_default_folders_follow_the_task_and_the_model():
    assert load_config(None, []).train.output_dir == "runs/grounding-tiny"
    assert load_config(None, ["data.task=math"]).train.output_dir == "runs/math-tiny"
    assert load_config(None, ["data.tasks={vqa: 1, grounding: 2}"]).train.output_dir == "runs/grounding+vqa-tiny"
    assert load_config(None, ["model.name_or_path=Qwen/Qwen2.5-VL-3B-Instruct"]).train.output_dir == "runs/grounding-Qwen2.5-VL-3B-Instruct"
    assert load_config(None, ["model.name_or_path=runs/a/checkpoints/step-000010/model"]).train.output_dir == "runs/grounding-a-step-000010"
    assert load_config(None, ["train.output_dir=mine"]).train.output_dir == "mine"


def test_evaluations_of_other_models_or_tasks_keep_the_earlier_results(untrained_tiny_dir, tmp_path, monkeypatch):
    """``evaluate`` always wrote evals/latest, replacing the last results.md. Planted: the old default; the
    second evaluation replaced the first's results."""
    from vlm_grpo_ma.tools import evaluate

    monkeypatch.chdir(tmp_path)
    common = ["--limit", "1", "--max-thought-tokens", "3", "--max-answer-tokens", "3", "--no-progress", "--draw", "0"]
    assert evaluate.main(["--models", str(untrained_tiny_dir), "--tasks", "grounding", *common]) == 0
    assert evaluate.main(["--models", str(untrained_tiny_dir), "--tasks", "vqa", *common]) == 0
    folders = sorted(p.name for p in (tmp_path / "evals").iterdir())
    assert folders == [f"{untrained_tiny_dir.name}--grounding", f"{untrained_tiny_dir.name}--vqa"]
    assert all((tmp_path / "evals" / f / "results.md").is_file() for f in folders)
