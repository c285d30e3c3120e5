"""Issue 12, runs that survive: SIGTERM, unreadable images, non-finite numbers, bad data messages, resumed logs."""

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, tiny_run_config
from PIL import Image
from safetensors.torch import load_file

from tasks import grounding
from vlm_grpo_ma.algorithm.diagnostics import GradSpikeMonitor
from vlm_grpo_ma.model.prompts import encode_prompt, open_image
from vlm_grpo_ma.run import loop as train_module
from vlm_grpo_ma.run import setup as run_setup_module
from vlm_grpo_ma.run import update as update_module
from vlm_grpo_ma.run.checkpoint import checkpoint_dir, latest_checkpoint, list_checkpoints
from vlm_grpo_ma.run.survive import NonFiniteError
from vlm_grpo_ma.task_api import read_rows
from vlm_grpo_ma.task_api.images import ImageLoadError
from vlm_grpo_ma.task_api.registry import Sample, count_load_skips
from vlm_grpo_ma.task_api.streams import PromptStream, TaskMixture

ROOT = Path(__file__).resolve().parents[1]
LENGTH_TASK = str(ROOT / "tests" / "fixtures" / "answer_length_task.py")


def _cfg(model_dir, out_dir, *extra):
    return tiny_run_config(model_dir, out_dir, *extra)


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _bomb_png(path, side=20000):
    """A valid PNG header declaring side x side pixels (4e8 for 20000: over twice Image.MAX_IMAGE_PIXELS, so
    PIL raises DecompressionBombError, which is neither OSError nor ValueError), with a tiny body."""

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit greyscale
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)
    return path


# ---------------------------------------------------------------------------------------------- SIGTERM


def test_sigterm_saves_the_last_completed_step_and_resume_continues(untrained_tiny_dir, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable,
        "-m",
        "vlm_grpo_ma.train",
        "--task",
        "grounding",
        "--output-dir",
        str(run),
        f"model.name_or_path={untrained_tiny_dir}",
        "train.steps=50",
        "train.checkpoint_every=100",
        *TINY_RUN,
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").exists() and len(_records(run / "metrics.jsonl")) >= 2):
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "no two steps within 120 s"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, output
    last_logged = _records(run / "metrics.jsonl")[-1]["step"]
    assert last_logged >= 2
    assert latest_checkpoint(run).name == f"step-{last_logged:06d}", output  # nothing done was lost

    train_module.train(_cfg(untrained_tiny_dir, run, f"train.steps={last_logged + 1}"), resume=True)
    assert latest_checkpoint(run).name == f"step-{last_logged + 1:06d}"
    assert [r["step"] for r in _records(run / "metrics.jsonl")] == list(range(1, last_logged + 2))


def test_ctrl_c_ends_with_the_checkpoint_saved_and_the_command_that_continues(untrained_tiny_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C in step 3 of 3: the two steps done are saved on the way out, and the run's last word is the
    checkpoint and the command that continues it, which then finishes the run; stopped before any checkpoint, it
    says there is nothing to continue. Planted: no such line (as before: the log's "saving a checkpoint" only)."""
    from vlm_grpo_ma.run import cli

    run = tmp_path / "run"
    sample_step = train_module.sample_step

    def stop_in_step_3(run_state, step):
        if step == 2:
            raise KeyboardInterrupt  # Ctrl-C
        return sample_step(run_state, step)

    monkeypatch.setattr(train_module, "sample_step", stop_in_step_3)
    arguments = ["--output-dir", str(run), f"model.name_or_path={untrained_tiny_dir}", "train.steps=3", "train.checkpoint_every=100"]
    assert cli.main([*arguments, *TINY_RUN]) == 130
    said = [line for line in capsys.readouterr().err.splitlines() if "Continue with" in line]
    assert said == [
        f"stopped; checkpoint {checkpoint_dir(run, 2)} holds step 2. Continue with: python -m vlm_grpo_ma.train --output-dir {run} --resume"
    ]
    monkeypatch.setattr(train_module, "sample_step", sample_step)
    assert cli.main(said[0].split("python -m vlm_grpo_ma.train ")[1].split()) == 0  # the command, as printed
    assert latest_checkpoint(run).name == "step-000003"
    assert cli.how_to_continue(tmp_path / "fresh") == (
        "stopped before the first checkpoint, so there is nothing to continue; to start again, add --overwrite to the same command"
    )


# ---------------------------------------------------------------------------------------------- images


def test_an_image_over_the_pixel_limit_is_an_image_load_error(tmp_path):
    with pytest.raises(ImageLoadError, match="DecompressionBombError"):
        open_image(str(_bomb_png(tmp_path / "huge.png")))


# Images PIL opens but the processor refuses (Qwen: an aspect ratio of 200 or more), beside PIL's own refusal
IMAGE_GALLERY = {
    "wide_2000x8": lambda path: Image.new("RGB", (2000, 8)).save(path) or path,
    "tall_8x2000": lambda path: Image.new("RGB", (8, 2000)).save(path) or path,
    "over_the_pixel_limit": lambda path: _bomb_png(path),
}


@pytest.mark.parametrize("name", list(IMAGE_GALLERY))
def test_hostile_images_are_image_load_errors(name, tiny_policy, tmp_path):
    image = IMAGE_GALLERY[name](tmp_path / f"{name}.png")
    sample = grounding.load()[0]
    hostile = type(sample)(sample.task, "hostile", sample.question, (str(image),), sample.answer, sample.meta)
    with pytest.raises(ImageLoadError):
        encode_prompt(tiny_policy, hostile, "")


def test_a_data_file_with_an_image_the_processor_refuses_trains_to_the_end(untrained_tiny_dir, tmp_path):
    wide = IMAGE_GALLERY["wide_2000x8"](tmp_path / "wide.png")
    rows = [json.loads(line) for line in _grounding_source(tmp_path, wide).read_text().splitlines()[:4]]
    rows[-1]["width"], rows[-1]["height"] = 2000, 8  # the row holding the wide image, found mid-run
    source = tmp_path / "wide.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=2", f"data.source={source}"))
    records = _records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["count/skipped_broken_images"] >= 1


def _grounding_source(tmp_path, bomb):
    """Three embedded samples (absolute image paths), a row whose image is over PIL's pixel limit but whose
    size is given (found mid-run) and one without a size (found at load, reading the header)."""
    rows = [
        json.loads(line)
        for line in (ROOT / "data" / "grounding" / "train.jsonl").read_text().splitlines()[:3]
    ]
    for row in rows:
        row["image"] = str(ROOT / "data" / "grounding" / row["image"])
    box = {"expression": "the square", "box": [1, 1, 20, 20]}
    rows.append({"id": "huge_mid_run", "image": str(bomb), "width": 168, "height": 168, **box})
    rows.append({"id": "huge_at_load", "image": str(bomb), **box})
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return source


def test_unreadable_images_are_skipped_and_counted_at_load_and_mid_run_and_resume_continues(
    untrained_tiny_dir, tmp_path
):
    source = _grounding_source(tmp_path, _bomb_png(tmp_path / "huge.png"))
    with count_load_skips() as skipped:
        assert [s.id for s in grounding.load(source=str(source))][-1] == "huge_mid_run"
    assert skipped == {"broken_images": 1}

    run = tmp_path / "run"
    # 6 draws from 4 samples: every sample is drawn at least once
    train_module.train(
        _cfg(untrained_tiny_dir, run, "train.steps=3", "train.checkpoint_every=1", f"data.source={source}")
    )
    last = _records(run / "metrics.jsonl")[-1]
    assert last["count/skipped_broken_images_at_load"] == 1
    assert last["count/skipped_broken_images"] >= 1
    train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=5", f"data.source={source}"), resume=True)
    assert latest_checkpoint(run).name == "step-000005"
    assert _records(run / "metrics.jsonl")[-1]["count/skipped_broken_images_at_load"] == 1  # not 2 on resume
    assert _records(run / "metrics.jsonl")[-1]["count/skipped_broken_images"] >= 2  # passed it again, epoch 2


def test_other_loaders_skip_and_count_an_unreadable_image_but_name_a_missing_one(tmp_path):
    from tasks import affordance
    from vlm_grpo_ma.task_api import image_from_cell

    bomb = _bomb_png(tmp_path / "huge.png")
    scene = ROOT / "tests" / "fixtures" / "affordance" / "project" / "images" / "scene.png"
    rows = [
        {"id": "ok", "image": str(scene), "question": "q", "box": [1, 2, 3, 4]},
        {"id": "huge", "image": str(bomb), "question": "q", "box": [1, 2, 3, 4]},
    ]
    source = tmp_path / "affordance.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with count_load_skips() as skipped:
        assert [s.id for s in affordance.load(source=str(source))] == ["ok"]
    assert skipped == {"broken_images": 1}
    # image bytes in a parquet/JSON cell (vqa, math): ImageLoadError, which their loaders skip and count
    with pytest.raises(ImageLoadError, match="rows.parquet: row 3: image bytes cannot be read"):
        image_from_cell({"bytes": bomb.read_bytes()}, tmp_path, "rows.parquet: row 3")
    # a missing file is a wrong path or image root: named at load, not skipped
    missing = _grounding_rows(tmp_path, image="nowhere.png")
    text = missing.read_text().splitlines()
    missing.write_text(
        text[0] + "\n" + json.dumps({k: v for k, v in json.loads(text[1]).items() if k != "width"}) + "\n"
    )
    with pytest.raises(FileNotFoundError, match=r"rows.jsonl:2: image file not found: .*nowhere.png"):
        grounding.load(source=str(missing))


def test_the_main_process_names_a_broken_image_of_another_process_share(caplog):
    """Each process of a launch decodes only its share of a step's images, and only the main process logs
    warnings (distributed.quiet_other_processes): an image broken in process 1's share was named by process 1
    alone, now quiet. Every process learns every failure at the exchange and names it there, once per file.
    Process 0 of 2 here; the exchange stands for gather_object, process 1's part made as process 1 makes it.
    Planted: the warning where the image failed to encode (process 0 said nothing)."""
    samples = [Sample("t", f"main-names-{i}", "q", (f"img{i}",), None) for i in range(8)]
    first_two = PromptStream(samples, seed=0).take(2)  # a step of 2 prompts on 2 processes: process 1 encodes the 2nd
    broken = first_two[1].id

    def encode(sample):
        if sample.id == broken:
            raise ImageLoadError(f"{sample.id}.png is broken")
        return f"prompt of {sample.id}"

    rounds = []

    def exchange(work):
        rounds.append(work)
        theirs = train_module.encode_candidates(first_two, [False, True], encode, {}) if len(rounds) == 1 else {}
        return [work(), theirs]

    counters = Counter()
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.train"):
        for _ in range(2):
            drawn, _ = train_module.draw_prompts(PromptStream(samples, seed=0), 2, encode, counters, process_index=0,
                                                 num_processes=2, exchange=exchange)  # fmt: skip
            rounds.clear()
    assert broken not in [s.id for s in drawn] and counters["skipped_broken_images"] == 2  # each time, counted
    said = [r.getMessage() for r in caplog.records if broken in r.getMessage()]
    assert said == [f"skipping sample {broken}: {broken}.png is broken"]  # once


# ---------------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize(
    "setting, value, named",
    [
        ("train.learning_rate", math.inf, "train/learning_rate"),
        ("data.reward_weights", {"iou": math.inf}, "reward"),
    ],
)
def test_a_non_finite_value_stops_the_run_naming_it_and_never_checkpoints_non_finite_weights(
    untrained_tiny_dir, tmp_path, setting, value, named
):
    run = tmp_path / "run"
    cfg = _cfg(untrained_tiny_dir, run, "train.checkpoint_every=1")
    section, key = setting.split(".")
    setattr(getattr(cfg, section), key, value)  # as if validation had let it through
    with pytest.raises(NonFiniteError, match=rf"step 1: {named}\b.* is not finite"):
        train_module.train(cfg)
    for checkpoint in list_checkpoints(run):
        assert all(
            torch.isfinite(t).all() for t in load_file(checkpoint / "model" / "model.safetensors").values()
        )
    assert list_checkpoints(run) == []


def test_a_later_non_finite_step_keeps_the_last_finite_checkpoint(untrained_tiny_dir, tmp_path, monkeypatch):
    real_update = train_module.update_policy
    calls = {"n": 0}

    def update_then_poison(policy, *args, **kwargs):
        calls["n"] += 1
        metrics = real_update(policy, *args, **kwargs)
        if calls["n"] == 3:  # step 3's optimiser step wrote NaN into one weight
            next(p for p in policy.model.parameters() if p.requires_grad).data[0] = float("nan")
        return metrics

    monkeypatch.setattr(train_module, "update_policy", update_then_poison)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"step 3: weight .* is not finite"):
        train_module.train(_cfg(untrained_tiny_dir, run, "train.checkpoint_every=2"))
    # step 3's weights are not saved (nor, being gone, step 2's again): the last checkpoint is kept as it was
    assert [p.name for p in list_checkpoints(run)] == ["step-000002"]
    weights = load_file(latest_checkpoint(run) / "model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_an_infinite_task_weight_is_refused_by_the_mixture():
    streams = {name: PromptStream([object()], seed=0) for name in ("a", "b")}
    with pytest.raises(ValueError, match="finite and > 0"):
        TaskMixture(streams, {"a": math.inf, "b": 1.0}, seed=0)


# ---------------------------------------------------------------------------------------------- data messages


def test_jsonl_errors_name_the_file_line_and_column(tmp_path):
    path = tmp_path / "rows.jsonl"
    # line 2 holds a carriage return between tokens (JSON whitespace): still one line
    path.write_bytes(b'{"a": 1}\n{"a": 2,\r "b": 3}\n{"a": 3,, }\n')
    with pytest.raises(ValueError) as error:
        read_rows(path)
    assert str(error.value).startswith(
        f"{path}:3: not JSON (Expecting property name enclosed in double quotes at column 9)"
    )
    assert "line 1" not in str(error.value)
    path.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')
    with pytest.raises(
        ValueError, match=rf"{path}:2: not UTF-8 text \(invalid continuation byte at column 11\)"
    ):
        read_rows(path)


def _grounding_rows(tmp_path, **changes):
    image = ROOT / "data" / "grounding" / "images" / "train_00000.png"
    good = {
        "id": "ok",
        "image": str(image),
        "expression": "the square",
        "box": [10, 10, 50, 50],
        "width": 168,
        "height": 168,
    }
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "a", **changes}) + "\n")
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"expression": 5}, r"rows.jsonl:2: 'expression' must be a non-empty string, got 5"),
        (
            {"box": [float("nan"), 1, 5, 5]},
            r"rows.jsonl:2: box \[nan, 1.0, 5.0, 5.0\] must hold finite numbers",
        ),
        ({"box": [200, 200, 300, 300]}, r"rows.jsonl:2: box .* has no area inside the 168x168 image"),
        ({"box": [10, 10, 10, 50]}, r"rows.jsonl:2: box .* has no area inside"),
        ({"width": 0}, r"rows.jsonl:2: width and height must be positive numbers"),
        ({"box": [1, "two", 3, 4]}, r"rows.jsonl:2: a box needs 4 numbers"),
        ({"image": 7}, r"rows.jsonl:2: 'image' must be a path string"),
    ],
)
def test_bad_grounding_rows_name_the_file_line_and_key(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        grounding.load(source=str(_grounding_rows(tmp_path, **changes)))


def test_a_ground_truth_box_partly_outside_the_image_is_clipped_and_corners_sorted(tmp_path):
    samples = grounding.load(source=str(_grounding_rows(tmp_path, box=[180, 50, 100, -5])))
    assert samples[1].answer == [100.0, 0.0, 168.0, 50.0]


def test_a_malformed_grounding_line_names_its_line(tmp_path):
    path = _grounding_rows(tmp_path)
    path.write_text(path.read_text() + "{oops\n")
    with pytest.raises(ValueError, match=rf"{path}:3: not JSON \(Expecting property name .* at column 2\)"):
        grounding.load(source=str(path))


# ---------------------------------------------------------------------------------------------- resumed logs


def test_a_resumed_run_does_not_log_its_resumed_steps_twice(untrained_tiny_dir, tmp_path):
    run = tmp_path / "run"
    train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=3", "train.checkpoint_every=2"))
    # killed (SIGKILL, power loss) after step 3 was logged but before it was checkpointed
    shutil.rmtree(latest_checkpoint(run))
    assert latest_checkpoint(run).name == "step-000002"
    train_module.train(
        _cfg(untrained_tiny_dir, run, "train.steps=3", "train.checkpoint_every=2"), resume=True
    )
    assert [r["step"] for r in _records(run / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in _records(run / "rollouts.jsonl")] == [1, 1, 2, 2, 3, 3]


def test_a_resumed_run_logs_the_spike_ratios_of_a_straight_run(untrained_tiny_dir, tmp_path, monkeypatch):
    # A window of one step makes the ratio known from step 2 on: a straight run logs each step's grad norm
    # over the previous step's. The checkpoint of step 1 must hold step 1's norm for the run resumed from
    # it to log the same at step 2 (it logged nan: the checkpoint was taken before the norm joined).
    monkeypatch.setattr(run_setup_module, "GradSpikeMonitor", functools.partial(GradSpikeMonitor, window=1))
    run = tmp_path / "run"
    task = ("data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]")  # a gradient from step 1 on
    train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=1", "train.checkpoint_every=1", *task))
    train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=3", "train.checkpoint_every=1", *task), resume=True)
    records = _records(run / "metrics.jsonl")
    norms = [r["train/grad_norm"] for r in records]
    assert all(norm > 0 for norm in norms)
    assert [r["train/grad_norm_spike_ratio"] for r in records[1:]] == [norms[1] / norms[0], norms[2] / norms[1]]


def test_a_corrupt_newest_checkpoint_resumes_from_the_one_before_naming_the_file(
    untrained_tiny_dir, tmp_path, caplog
):
    run = tmp_path / "run"
    train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=2", "train.checkpoint_every=1"))
    state = latest_checkpoint(run) / "state.pt"
    os.truncate(state, state.stat().st_size // 2)  # a full disk or a killed copy
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.train"):
        train_module.train(_cfg(untrained_tiny_dir, run, "train.steps=3", "train.checkpoint_every=1"), resume=True)
    assert f"{state} does not load (RuntimeError" in caplog.text
    assert "continuing from " + str(run / "checkpoints" / "step-000001") in caplog.text
    assert [r["step"] for r in _records(run / "metrics.jsonl")] == [1, 2, 3]
    assert latest_checkpoint(run).name == "step-000003"


@pytest.mark.parametrize("cut", ["state.pt", "model/model.safetensors"])
def test_resume_refuses_a_run_whose_every_checkpoint_is_corrupt_naming_each_file(tmp_path, cut):
    from vlm_grpo_ma.model.tiny import build_untrained
    from vlm_grpo_ma.run.config import ConfigError
    from vlm_grpo_ma.run.run_dir import checkpoint_to_resume

    for step in (1, 2):
        folder = checkpoint_dir(tmp_path, step)
        build_untrained(folder / "model", seed=0)
        torch.save({"step": step}, folder / "state.pt")
        os.truncate(folder / cut, (folder / cut).stat().st_size // 2)
    with pytest.raises(ConfigError) as error:
        checkpoint_to_resume(tmp_path, resume=True)
    head, _, failures = str(error.value).partition(" loads: ")
    assert head == f"--resume: no checkpoint of {tmp_path}"
    named = [failure.split(" (")[0] for failure in failures.split("; ")]
    assert named == [f"{checkpoint_dir(tmp_path, step) / cut} does not load" for step in (2, 1)]
    assert checkpoint_to_resume(tmp_path, resume=False) == (None, None)


def test_a_resumed_run_replaces_its_relogged_steps_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vlm_grpo_ma.run.metrics import RunLogger
    from vlm_grpo_ma.run.trackers import open_trackers

    first = RunLogger(tmp_path, trackers=open_trackers(["tensorboard"], tmp_path), progress_bar=False, total_steps=3, start_step=0)
    for step in (1, 2, 3):
        first.log_step(step, {"reward/mean": float(step)})
    first.close()
    time.sleep(1.1)  # event files are named by the second: the resumed run's file sorts after the first's
    resumed = RunLogger(tmp_path, trackers=open_trackers(["tensorboard"], tmp_path, start_step=1), progress_bar=False,
                        total_steps=3, start_step=1)  # fmt: skip
    for step in (2, 3):
        resumed.log_step(step, {"reward/mean": 10.0 + step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 12.0), (3, 13.0)]


def test_a_non_finite_gradient_stops_before_the_optimiser_step_and_keeps_the_steps_done(untrained_tiny_dir, tmp_path, monkeypatch):
    """A NaN loss at step 3 is caught before the optimiser step: the weights are still step 2's, so the crash
    path checkpoints step 2 (checkpoint_every=100: nothing was saved before) instead of losing it."""
    real_loss = update_module.policy_loss
    calls = {"n": 0}

    def nan_at_step_3(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), stats) if calls["n"] > 2 * 3 else (loss, stats)  # 3 micro-batches a step

    monkeypatch.setattr(update_module, "policy_loss", nan_at_step_3)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"train/(loss|grad_norm) = nan is not finite .*before the optimiser step"):
        train_module.train(_cfg(untrained_tiny_dir, run, "train.checkpoint_every=100"))
    assert [p.name for p in list_checkpoints(run)] == ["step-000002"]
    weights = load_file(latest_checkpoint(run) / "model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


class _TwoProcesses:
    """The accelerator of process 0 of 2 whose peer has nothing to report: ``gather`` appends the peer's
    all-clear row. Stands in for the collective, not for the code under test (``survive.agree``)."""

    num_processes, process_index, device = 2, 0, torch.device("cpu")

    def gather(self, tensor):
        return torch.cat([tensor, torch.zeros_like(tensor)])


def test_a_pending_signal_waits_where_the_step_is_not_complete_and_stops_at_the_next_agreement():
    from vlm_grpo_ma.run import survive

    restore = survive.raise_on_sigterm(2)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert survive._pending_signal == [signal.SIGTERM]
        with survive.together(_TwoProcesses(), act_on_signals=False):  # the weights changed: not here
            pass
        with pytest.raises(survive.Terminated, match="process 0 received signal SIGTERM"):
            with survive.together(_TwoProcesses()):
                pass
    finally:
        restore()


def test_the_same_signal_twice_within_the_grace_is_one_request_and_later_raises_at_once(monkeypatch):
    from vlm_grpo_ma.run import survive

    restore = survive.raise_on_sigterm(2)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's copy
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's forwarded copy, milliseconds later: ignored
        assert survive._pending_signal == [signal.SIGTERM]
        monkeypatch.setattr(survive, "REPEAT_GRACE_S", 0.0)  # a repeat after the grace: the way out
        with pytest.raises(survive.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs at the next bytecode boundary of the main thread
                time.sleep(0.001)
    finally:
        restore()


@pytest.mark.parametrize(
    ("ending", "left_initialised"),
    [("returns", False), ("stops together", False), ("fails on this process alone", True), ("refuses", False)],
)
def test_a_launched_run_leaves_its_process_group_before_exit_unless_a_collective_may_be_in_flight(tmp_path, ending, left_initialised):
    """A process group left to interpreter teardown made gloo abort a DDP process now and then (SIGABRT,
    "terminate called without an active exception", seen once in CI in the SIGTERM test) instead of exiting
    with the run's code. The CLI destroys it when the run returned or stopped at a point every process reached,
    or refused (a ConfigError: every process of a launch refused a folder holding a run, and one aborted), and
    not after another error on one process alone; the error goes on out. Planted and seen to fail: the destroy
    call removed; destroying after every error; the error swallowed; a ConfigError left to teardown."""
    from vlm_grpo_ma.run.config import ConfigError
    from vlm_grpo_ma.run.distributed import process_group_left_at_the_end

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # an error must come out of the block as it went in
        kind = ConfigError if ending == "refuses" else RuntimeError
        stopping = contextlib.nullcontext() if ending == "returns" else pytest.raises(kind, match="^stop$")
        with stopping:
            with process_group_left_at_the_end():
                torch.distributed.all_reduce(torch.ones(1))  # the group was used, as a run uses it
                if ending != "returns":
                    error = kind("stop")
                    error.stopped_together = ending == "stops together"
                    raise error
        assert torch.distributed.is_initialized() is left_initialised
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
