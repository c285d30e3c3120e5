"""Evaluation drawings of video samples: drawn on a strip of the first video's frames as the model saw them
(the policy's video budget and patch factor), a video that does not decode skipped with a warning."""

import logging

from PIL import Image
from video_clips import write_clip

from vlm_grpo_ma.task_api.registry import Sample, Task, register_task
from vlm_grpo_ma.tools import evaluate

TASK_NAME = "video_drawing_test"


def _clip_samples(folder):
    """Two samples with an 8-frame 4 fps clip of 56x56 frames each, and one whose video is not a video."""
    folder.mkdir(parents=True, exist_ok=True)
    broken = folder / "broken.mp4"
    broken.write_bytes(b"not a video")
    return [
        Sample(TASK_NAME, "a", "What moves?", (), "square", videos=(str(write_clip(folder / "a.mp4")),)),
        Sample(TASK_NAME, "broken", "What moves?", (), "square", videos=(str(broken),)),
        Sample(TASK_NAME, "b", "What moves?", (), "square", videos=(str(write_clip(folder / "b.mp4")),)),
    ]


# The samples the throwaway task loads: each test writes its own clips (task names are registered once).
_CURRENT_SAMPLES: list[Sample] = []

# Its drawing is the strip it is given, as the video task draws on it.
register_task(Task(
    TASK_NAME, load=lambda split, source=None: list(_CURRENT_SAMPLES), reward=lambda completion, sample: {"reward": 0.0},
    instruction="Answer.", draw=lambda image, sample, prediction: image,
))


def _register(folder) -> None:
    _CURRENT_SAMPLES[:] = _clip_samples(folder)


def test_video_samples_are_drawn_on_a_strip_of_their_frames_and_a_broken_video_is_skipped(tmp_path, caplog):
    """Planted: draw_predictions kept to samples with images (as before videos) -> no drawing was written."""
    _register(tmp_path / "clips")
    out = tmp_path / "eval"
    args = ["--models", "tiny", "--tasks", TASK_NAME, "--max-thought-tokens", "2", "--max-answer-tokens", "2",
            "--draw", "8", "--output-dir", str(out), "--no-progress"]
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.evaluate"):
        assert evaluate.main(args) == 0
    drawings = sorted((out / "tiny" / f"{TASK_NAME}-test" / "draw").glob("*.png"))
    assert [p.name for p in drawings] == ["000-a.png", "002-b.png"]
    # The default budget's 2 fps over an 8-frame 4 fps clip: 4 frames; the tiny model's patch factor is 14 * 2 =
    # 28, so 56x56 frames stay 56x56; the strip is 4 frames and 3 gaps of 2 pixels wide (the legend keeps it).
    assert Image.open(drawings[0]).width == 4 * 56 + 3 * 2
    assert any("could not draw sample broken" in r.getMessage() for r in caplog.records)


def test_the_evaluate_commands_video_budget_reaches_the_drawings(tmp_path):
    """--video-max-frames 2 cuts the clip to 2 frames: the strip is 2 frames wide. Planted: the budget not
    passed to the policy (the default's 4 frames drawn) -> the width was 230, not 114."""
    _register(tmp_path / "clips")
    out = tmp_path / "eval"
    args = ["--models", "tiny", "--tasks", TASK_NAME, "--max-thought-tokens", "2", "--max-answer-tokens", "2",
            "--draw", "1", "--video-max-frames", "2", "--output-dir", str(out), "--no-progress"]
    assert evaluate.main(args) == 0
    (drawing,) = (out / "tiny" / f"{TASK_NAME}-test" / "draw").glob("*.png")
    assert Image.open(drawing).width == 2 * 56 + 2


def test_frames_are_drawn_at_the_sides_the_patch_factor_gives(tmp_path):
    """A model of patch 16 and merge 2 sees 56-pixel frames as 64 pixels (the nearest multiple of 32): so are
    they drawn. Planted: draw_predictions decoding at the default factor 28 -> the strip was 230 wide."""
    from vlm_grpo_ma.run import evaluation
    from vlm_grpo_ma.task_api.registry import get_task

    _register(tmp_path / "clips")
    sample = _CURRENT_SAMPLES[0]
    record = {"id": sample.id, "sample_index": 0, "prediction": None}
    drawn = evaluation.draw_predictions(get_task(TASK_NAME), [sample], [record], tmp_path / "draw", 1, patch_factor=32)
    assert drawn == 1
    (drawing,) = (tmp_path / "draw").glob("*.png")
    assert Image.open(drawing).width == 4 * 64 + 3 * 2


def test_the_evaluate_command_refuses_a_video_budget_under_two_frames(tmp_path, capsys):
    assert evaluate.main(["--video-max-frames", "1", "--output-dir", str(tmp_path / "e"), "--no-progress"]) == 2
    assert "--video-max-frames=1 must be >= 2" in capsys.readouterr().err


def test_a_runs_model_is_evaluated_at_the_video_budget_it_trained_with(tmp_path):
    """A run folder's saved config gives the budget (evaluate's --video-* unset); a folder without one gives
    none (training's defaults then). Planted: run_video_budget reading the defaults only; this failed."""
    from vlm_grpo_ma.run.config_files import load_config, save_config
    from vlm_grpo_ma.task_api.videos import VideoBudget

    cfg = load_config(None, ["model.video_fps=1.0", "model.video_max_frames=4", "model.video_max_pixels=3136"])
    save_config(cfg, tmp_path / "config.yaml")
    assert evaluate.run_video_budget(tmp_path) == VideoBudget(fps=1.0, max_frames=4, max_pixels=3136)
    assert evaluate.run_video_budget(tmp_path / "elsewhere") is None


def test_one_video_flag_replaces_only_its_key_of_the_runs_budget_and_a_resume_keeps_the_budget(tmp_path, untrained_tiny_dir, capsys):
    """A run that trained at 1 fps, 2 frames, 56x56 pixels, evaluated with --video-fps 4 alone: the other two
    keys stay the run's, so the 8-frame clip is seen (and drawn) as 2 frames; continuing that evaluation at
    another fps is refused in one line naming both budgets, before the model loads (stderr holds no loading
    bar); the same budget resumes. Planted: one flag setting the other keys to training's defaults (the budget
    became 4 fps, 16 frames, 100352 pixels), and the budget left out of settings.json (nothing recorded, so the
    resume at 2 fps would run); each failed here."""
    import json
    import shutil

    from vlm_grpo_ma.run.config_files import load_config, save_config

    _register(tmp_path / "clips")
    run = tmp_path / "run"
    shutil.copytree(untrained_tiny_dir, run / "checkpoints" / "step-000001" / "model")
    (run / "checkpoints" / "step-000001" / "state.pt").write_bytes(b"")  # evaluate reads the model only
    save_config(load_config(None, ["model.video_fps=1", "model.video_max_frames=2", "model.video_max_pixels=3136"]), run / "config.yaml")
    out = tmp_path / "eval"
    args = ["--models", str(run), "--tasks", TASK_NAME, "--max-thought-tokens", "2", "--max-answer-tokens", "2",
            "--draw", "1", "--output-dir", str(out), "--no-progress"]  # fmt: skip
    assert evaluate.main([*args, "--video-fps", "4"]) == 0
    bench = out / "run@step-000001" / f"{TASK_NAME}-test"
    assert json.loads((bench / "settings.json").read_text())["video_budget"] == {"fps": 4.0, "max_frames": 2, "max_pixels": 3136}
    (drawing,) = (bench / "draw").glob("*.png")
    assert Image.open(drawing).width == 2 * 56 + 2
    capsys.readouterr()
    assert evaluate.main([*args, "--video-fps", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {bench} holds an evaluation with other settings (video_budget: {{'fps': 4.0, 'max_frames': 2,"
        " 'max_pixels': 3136} there, {'fps': 2.0, 'max_frames': 2, 'max_pixels': 3136} now). Use another"
        " --output-dir, or delete that folder to start it again\n"
    )
    assert evaluate.main([*args, "--video-fps", "4"]) == 0


def test_the_evaluate_command_refuses_a_video_budget_under_one_vision_token(tmp_path, capsys):
    """783 pixels hold no 28x28 token: refused at once, naming the flag. Planted: the old `< 1` check -> the
    evaluation ran (every clip skipped by the resize's assert) and exited 0; failed here."""
    _register(tmp_path / "clips")
    args = ["--models", "tiny", "--tasks", TASK_NAME, "--max-thought-tokens", "2", "--max-answer-tokens", "2",
            "--draw", "0", "--video-max-pixels", "783", "--output-dir", str(tmp_path / "e"), "--no-progress"]
    assert evaluate.main(args) == 2
    assert "error: --video-max-pixels=783 must be >= 784, one vision token (28x28 pixels)" in capsys.readouterr().err


def test_a_budget_under_the_loaded_models_vision_token_is_refused_before_its_first_clip(tmp_path):
    """900 pixels pass the smallest family's token (28x28) but not a 32x32 one: refused once the model (a
    stand-in with that patch factor) is loaded, before any sample is scored. Planted: no check after the
    load -> evaluate_task ran on the stand-in and raised AttributeError; failed here."""
    import pytest

    from vlm_grpo_ma.run.config import ConfigError
    from vlm_grpo_ma.run.evaluation import EvalSettings

    class Loaded:  # what evaluate_models reads of a loaded model before scoring
        patch_factor = 32

    _register(tmp_path / "clips")
    with pytest.raises(ConfigError, match=r"--video-max-pixels=900 must be >= 1024, one vision token \(32x32 pixels on m\)"):
        evaluate.evaluate_models(
            [evaluate.ModelSpec("m", "m")], [TASK_NAME], split="test", sources={}, settings=EvalSettings(),
            output_dir=tmp_path / "e", limit=None, batch_size=1, draw=0, progress=False,
            load=lambda *a, **k: Loaded(), video_overrides={"max_pixels": 900},
        )  # fmt: skip


def test_a_runs_damaged_config_is_one_line_naming_it(tmp_path):
    """A run's config.yaml is read as --resume reads it. Planted: the old yaml.safe_load reader -> a ScannerError,
    an AttributeError, a ValueError naming no file, and silent defaults for the empty and key-less files; each
    failed here."""
    import pytest

    from vlm_grpo_ma.run.config import ConfigError
    from vlm_grpo_ma.run.config_files import load_config, save_config

    save_config(load_config(None, []), tmp_path / "good.yaml")
    good = (tmp_path / "good.yaml").read_text()
    cases = {
        "cut": (good[: good.index("rollout:")] + "rollout:\n  num_thoughts: 'fo", "not valid YAML"),  # mid-quote
        "model list": ("model: [1]\n", "model"),
        "fps word": (good.replace("video_fps: 2.0", "video_fps: fast"), "video_fps"),
        "empty": ("", "empty"),
        "key-less": ("model: {}\n", "lacks"),
    }
    for name, (text, reason) in cases.items():
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(text)
        with pytest.raises(ConfigError) as error:
            evaluate.run_video_budget(run)
        message = str(error.value)
        assert message.startswith(f"run {run}: its {run / 'config.yaml'}: ") and reason in message, (name, message)


def test_an_output_dir_the_os_refuses_is_one_line_naming_it_and_the_reason(tmp_path, capsys):
    """mkdir under /proc printed `error: 2` (an OSError's first arg is its errno). Planted: the OS's error
    printed as args[0]; `error: 2`."""
    assert evaluate.main(["--limit", "1", "--draw", "0", "--output-dir", "/proc/self/h11-eval", "--no-progress"]) == 2
    assert capsys.readouterr().err.endswith("error: /proc/self/h11-eval: No such file or directory\n")
