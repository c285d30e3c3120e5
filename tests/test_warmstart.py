"""The warm start's pieces: the per-token targets of the vision phase, the scene stream, one step of each phase."""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from vlm_grpo_ma.model.lora import freeze_vision, trainable_parameters
from vlm_grpo_ma.tools.warmstart import (
    SceneStream,
    TokenHeads,
    load_scene_generator,
    loosened,
    scene_vocabulary,
    supervised_step,
    target_text,
    token_targets,
    vision_step,
)


def test_token_targets_describe_what_covers_each_token():
    make_grounding = load_scene_generator()
    # 168 px on a 6 x 6 token grid: cells of 28 px. A blue square filling cell (row 0, col 1) exactly and a
    # red triangle covering most of cell (row 2, col 2) and a sliver (5%) of the cell to its right.
    square = make_grounding.SceneObject("square", "blue", "large", (28, 0, 56, 28))
    triangle = make_grounding.SceneObject("triangle", "red", "small", (58, 58, 85, 84))
    targets = token_targets([square, triangle], grid_side=6, image_side=168)
    colours, shapes = scene_vocabulary()

    assert targets["covered"].sum() == 2  # the sliver is under the 10% threshold
    assert targets["covered"][1] and targets["covered"][2 * 6 + 2]
    assert targets["colour"][1] == colours.index("blue") and targets["shape"][1] == shapes.index("square")
    assert targets["colour"][14] == colours.index("red") and targets["shape"][14] == shapes.index("triangle")
    assert torch.allclose(targets["box"][1], torch.tensor([28, 0, 56, 28]) / 168)
    assert torch.equal(targets["place"][0], torch.tensor([0.0, 0.0]))
    assert torch.allclose(targets["place"][2 * 6 + 3], torch.tensor([2 / 5, 3 / 5]))
    assert torch.equal(targets["box"][0], torch.zeros(4))  # nothing there


def test_the_larger_overlap_wins_a_shared_token():
    make_grounding = load_scene_generator()
    small = make_grounding.SceneObject("circle", "green", "small", (0, 0, 10, 10))  # 100 px^2 of the cell
    large = make_grounding.SceneObject("square", "yellow", "large", (12, 0, 50, 28))  # 16 x 28 px of it
    targets = token_targets([small, large], grid_side=6, image_side=168)
    assert targets["colour"][0] == scene_vocabulary()[0].index("yellow")


def test_scene_stream_is_reproducible_and_scored_by_the_grounding_task():
    first, again, other = SceneStream(5).take(3), SceneStream(5).take(3), SceneStream(6).take(3)
    assert [s.sample.question for s in first] == [s.sample.question for s in again]
    assert [s.sample.answer for s in first] == [s.sample.answer for s in again]
    assert [s.sample.answer for s in first] != [s.sample.answer for s in other]
    for scene in first:
        box = scene.sample.answer
        assert any(list(obj.box) == box for obj in scene.objects)
        assert scene.sample.meta["reference_thought"].startswith("the ")


@pytest.mark.parametrize("phase", ["vision", "decoder"])
def test_one_step_of_each_phase_moves_only_what_it_trains(tiny_policy, phase):
    policy = tiny_policy
    scenes = SceneStream(7).take(2)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    if phase == "vision":
        heads = TokenHeads(policy.model.config.vision_config.out_hidden_size)
        parameters = [*policy.model.model.visual.parameters(), *heads.parameters()]
        loss = vision_step(policy, heads, scenes)
    else:
        from vlm_grpo_ma.task_api.registry import get_task

        freeze_vision(policy.model)
        parameters = trainable_parameters(policy.model)
        loss = supervised_step(policy, [s.sample for s in scenes], get_task("grounding").instruction)
    optimizer = torch.optim.SGD(parameters, lr=1e-2)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    moved = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    with torch.no_grad():  # put the shared fixture back
        for name, p in policy.model.named_parameters():
            p.copy_(before[name])
    policy.model.requires_grad_(True)
    vision_moved = {n for n in moved if n.startswith("model.visual.")}
    assert torch.isfinite(loss)
    if phase == "vision":
        assert vision_moved and moved == vision_moved
    else:
        assert moved and not vision_moved


def test_target_text_writes_the_box_in_the_models_frame(tiny_policy):
    sample = SceneStream(8).take(1)[0].sample
    text = target_text(tiny_policy, sample, input_size=(84, 84), original_size=(168, 168))
    x1, y1, x2, y2 = (round(v / 2) for v in sample.answer)  # Qwen2.5-VL: pixels of the 84 px input
    assert text == f"<think>{sample.meta['reference_thought']}</think><answer>[{x1},{y1},{x2},{y2}]</answer>"


@pytest.mark.parametrize(
    ("box", "margin", "loose"),
    [
        ([50, 60, 80, 100], 10, [40.0, 50.0, 90.0, 110.0]),  # grown on every side
        ([5, 2, 30, 40], 10, [0.0, 0.0, 40.0, 50.0]),  # clipped at the top-left corner
        ([140, 150, 165, 168], 10, [130.0, 140.0, 168.0, 168.0]),  # and at the bottom-right (168 px image)
        ([50, 60, 80, 100], 0, [50.0, 60.0, 80.0, 100.0]),
    ],
)
def test_loose_labels_grow_the_box_inside_the_image(box, margin, loose):
    assert loosened(box, margin, 168, 168) == loose


def test_target_text_with_a_margin_writes_the_loose_box(tiny_policy):
    sample = SceneStream(8).take(1)[0].sample
    text = target_text(tiny_policy, sample, input_size=(168, 168), original_size=(168, 168), box_margin=10)
    x1, y1, x2, y2 = loosened(sample.answer, 10, 168, 168)
    assert text.endswith(f"<answer>[{round(x1)},{round(y1)},{round(x2)},{round(y2)}]</answer>")
    assert sample.answer[0] - x1 == 10 or x1 == 0  # the label really is looser than the truth


@pytest.mark.parametrize("margin", ["-1", "nan"])
def test_a_negative_or_nan_margin_is_refused_before_any_work(margin, capsys, tmp_path):
    from vlm_grpo_ma.tools.warmstart import main

    with pytest.raises(SystemExit):  # --out: were the check missing, the warm start would write there
        main(["--box-margin", margin, "--out", str(tmp_path / "model")])
    assert f"--box-margin must be a number of pixels >= 0, got {float(margin)}" in capsys.readouterr().err


def test_token_targets_count_the_object_centres_in_each_token():
    make_grounding = load_scene_generator()
    # 112 px on a 4 x 4 grid: cells of 28 px. Two small objects with their centres in cell (0, 0), one in (3, 3),
    # and one whose top-left corner is in cell (0, 0) but whose centre (30, 30) is in cell (1, 1).
    a = make_grounding.SceneObject("circle", "red", "small", (2, 2, 12, 12))
    b = make_grounding.SceneObject("square", "blue", "small", (14, 14, 26, 26))
    c = make_grounding.SceneObject("triangle", "green", "small", (90, 90, 110, 110))
    d = make_grounding.SceneObject("circle", "yellow", "small", (20, 20, 40, 40))
    centres = token_targets([a, b, c, d], grid_side=4, image_side=112)["centres"]
    assert centres[0] == 2 and centres[5] == 1 and centres[15] == 1 and centres.sum() == 4


def test_counting_stream_is_reproducible_and_its_reference_completion_scores_full_marks(tiny_policy):
    from vlm_grpo_ma.task_api.registry import Completion, get_task
    from vlm_grpo_ma.tools.warmstart import CountingStream

    first, again, other = CountingStream(5).take(4), CountingStream(5).take(4), CountingStream(6).take(4)
    assert [s.sample.question for s in first] == [s.sample.question for s in again]
    assert [s.sample.answer for s in first] == [s.sample.answer for s in again]
    assert [s.sample.question for s in first] != [s.sample.question for s in other]
    math_task = get_task("math")
    for scene in first:
        sample = scene.sample
        assert sample.task == "math" and len(sample.images) == 1 and 3 <= len(scene.objects) <= 8
        assert sample.answer == re.findall(r"\d+", sample.meta["reference_thought"])[-1]  # the thought's result
        if sample.question == "How many shapes are there in total?":
            assert sample.answer == str(len(scene.objects))
        text = target_text(tiny_policy, sample, input_size=(112, 112), original_size=(112, 112))
        assert text == f"<think>{sample.meta['reference_thought']}</think><answer>{sample.answer}</answer>"
        cut = text.index("</think>") + len("</think>")
        parts = math_task.reward(Completion(thought=text[:cut], answer=text[cut:]), sample)
        assert parts["accuracy"] == 1.0 and parts["format"] == 1.0 and parts["right_thought"] == 1.0


def test_a_counting_vision_step_trains_the_centres_head(tiny_policy):
    from vlm_grpo_ma.tools.warmstart import CountingStream

    heads = TokenHeads(tiny_policy.model.config.vision_config.out_hidden_size, count_centres=True)
    loss = vision_step(tiny_policy, heads, CountingStream(3).take(2))
    loss.backward()
    assert heads.centres.weight.grad is not None and heads.centres.weight.grad.abs().sum() > 0
    tiny_policy.model.zero_grad(set_to_none=True)


def test_a_box_margin_is_refused_for_counting(capsys, tmp_path):
    from vlm_grpo_ma.tools.warmstart import main

    with pytest.raises(SystemExit):
        main(["--task", "counting", "--box-margin", "5", "--out", str(tmp_path / "model")])
    assert "--box-margin loosens grounding boxes; --task counting has none" in capsys.readouterr().err


def test_slips_change_only_the_last_sum_of_sum_and_add_labels():
    from vlm_grpo_ma.tools.warmstart import CountingStream

    true, slipped_labels = CountingStream(32).take(60), CountingStream(32, slip_rate=1.0).take(60)
    assert [s.sample.question for s in true] == [s.sample.question for s in slipped_labels]  # the same problems
    changed = 0
    for exact, slip in zip(true, slipped_labels, strict=True):
        thought, slip_thought = exact.sample.meta["reference_thought"], slip.sample.meta["reference_thought"]
        if exact.sample.question.startswith("If you add") or " plus " in exact.sample.question:  # add / sum kinds
            assert int(slip.sample.answer) == int(exact.sample.answer) - 1
            head = thought.rsplit("= ", 1)[0]
            assert slip_thought == f"{head}= {int(exact.sample.answer) - 1}."
            changed += 1
        else:
            assert (slip_thought, slip.sample.answer) == (thought, exact.sample.answer)
    assert changed >= 15
    unslipped = CountingStream(32, slip_rate=0.0).take(60)
    assert [s.sample.answer for s in unslipped] == [s.sample.answer for s in true]


@pytest.mark.parametrize(("args", "message"), [
    (["--task", "counting", "--slip-rate", "1.5"], "--slip-rate must be a share in [0, 1], got 1.5"),
    (["--task", "grounding", "--slip-rate", "0.5"], "--slip-rate puts slips in counting and video labels; --task grounding has none"),
])
def test_a_bad_slip_rate_is_refused_before_any_work(args, message, capsys, tmp_path):
    from vlm_grpo_ma.tools.warmstart import main

    with pytest.raises(SystemExit):  # --out: were the check missing, the warm start would write there
        main([*args, "--out", str(tmp_path / "model")])
    assert message in capsys.readouterr().err


def test_video_stream_clips_score_full_marks_and_slipped_labels_count_one_crossing_short(tiny_policy):
    """The video warm start's clips go through mp4 and the video task's row reader; their reference completion
    scores full marks. With slip_rate 1 every crossings label with a crossing (and only those) counts one short,
    its sides unchanged, and the same clips come out. Planted: miscounted changing the answer only (the thought
    kept); this failed."""
    from vlm_grpo_ma.task_api.registry import Completion, get_task
    from vlm_grpo_ma.tools.warmstart import COUNT_WORDS, VideoStream

    true, slipped_labels = VideoStream(7).take(30), VideoStream(7, slip_rate=1.0).take(30)
    video_task = get_task("video")
    slipped_count = 0
    for exact, slip in zip(true, slipped_labels, strict=True):
        sample, other = exact.sample, slip.sample
        assert sample.question == other.question and len(sample.videos) == 1
        text = target_text(tiny_policy, sample, None, None)
        cut = text.index("</think>") + len("</think>")
        assert video_task.reward(Completion(thought=text[:cut], answer=text[cut:]), sample)["accuracy"] == 1.0
        thought, slip_thought = sample.meta["reference_thought"], other.meta["reference_thought"]
        if sample.meta.get("clip_kind") == "crossings" and sample.answer != "0":
            count = int(sample.answer)
            assert other.answer == str(count - 1)
            assert slip_thought.split(":")[0] == thought.split(":")[0]  # the sides as they are
            assert slip_thought.endswith("it never crosses" if count == 1 else f"it crosses {COUNT_WORDS[count - 1]}")
            slipped_count += 1
        else:
            assert (other.answer, slip_thought) == (sample.answer, thought)
    assert slipped_count >= 2


def test_a_video_vision_step_trains_on_every_pair_of_frames(tiny_policy):
    """Targets per temporal patch: a shape shown in either frame of a pair is under that pair's tokens."""
    from vlm_grpo_ma.tools.warmstart import VideoStream, video_vision_step

    scenes = VideoStream(3).take(2)
    assert all(len(scene.objects) == 4 for scene in scenes)  # 8 frames: 4 pairs
    heads = TokenHeads(tiny_policy.model.config.vision_config.out_hidden_size)
    loss = video_vision_step(tiny_policy, heads, scenes)
    loss.backward()
    assert heads.colour.weight.grad is not None and heads.colour.weight.grad.abs().sum() > 0
    tiny_policy.model.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------------------
# Any registered task: the supervised cold start from its own training split (Task.target)

TOY_TASK = '''
from PIL import Image

from vlm_grpo_ma.task_api import Sample, Task, extract_tag, register_task

COLOURS = {{"red": (215, 40, 40), "blue": (40, 90, 215)}}


def load(split="train", source=None):
    names = sorted(COLOURS) * (4 if split == "train" else 1)
    return [Sample("{name}", f"{{split}}-{{i}}", "What colour is it?", (Image.new("RGB", (56, 56), COLOURS[c]),), c)
            for i, c in enumerate(names)]


def reward(completion, sample):  # a bonus of 0.25 for any text: no other task's reward scores so
    parts = {{"accuracy": float(extract_tag(completion.text, "answer") == sample.answer), "bonus": 0.25}}
    return {{**parts, "reward": 2.0 * parts["accuracy"] + parts["bonus"]}}


def target(sample):
    return f"<think>it is {{sample.answer}}</think><answer>{{sample.answer}}</answer>"


TASK = register_task(Task(name="{name}", load=load, reward=reward, instruction="Answer.", metrics=("accuracy",),
                          reward_weights={{"accuracy": 2.0, "bonus": 1.0}}, target={target}))
'''


@pytest.fixture
def toy_task(tmp_path, monkeypatch, fresh_registry):
    """Writes an out-of-tree task file ``{name}.py`` (a colour-naming task on plain 56 px images, with ``target``
    or without) and returns its path; the registry and the imported module are forgotten after the test."""

    def write(name: str, *, with_target: bool = True) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(TOY_TASK.format(name=name, target="target" if with_target else "None"))
        monkeypatch.setitem(sys.modules, f"user_task_{name}", None)
        monkeypatch.delitem(sys.modules, f"user_task_{name}")
        return path

    return write


def test_a_task_without_target_is_refused_in_one_line_naming_it(toy_task, tmp_path, capsys):
    """Planted: require_target removed; the warm start went on, every target failed, and it said so without
    naming the function to add. This failed."""
    from vlm_grpo_ma.tools.warmstart import main

    path = toy_task("no_target", with_target=False)
    with pytest.raises(SystemExit) as stopped:
        main(["--task", "no_target", "--task-module", str(path), "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and error.count("\n") == 1
    assert "task 'no_target' has no target" in error and "add target=... to its Task" in error
    assert "target(sample) -> str" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--vision-steps", "5"], "--vision-steps belong to the generated streams"),
    (["--out", "{tmp}"], "exists and is not a warm start's folder (no warmstart.json)"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
])
def test_bad_arguments_for_a_task_are_refused_in_one_line(toy_task, tmp_path, capsys, args, message):
    from vlm_grpo_ma.tools.warmstart import main

    path = toy_task("toy_args")
    (tmp_path / "taken.txt").write_text("a run's file")
    args = [arg.format(tmp=tmp_path) for arg in args]
    with pytest.raises(SystemExit):
        main(["--task", "toy_args", "--task-module", str(path), "--out", str(tmp_path / "new"), *args])
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_a_warm_start_learns_its_targets_and_scores_with_the_tasks_reward(toy_task, tmp_path, untrained_tiny_dir):
    """The generic warm start on an out-of-tree task (--task-module, a .py file): the loss on the task's targets
    falls, the output is a model folder load_policy takes, and warmstart.json's before and after are what
    `evaluate --task-module` gives the starting and the written model with the task's own reward. Planted: (1)
    the held-out scored with the grounding task's reward: failed; (2) the after-eval skipped (after = before):
    failed."""
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.model.prompts import encode_prompt
    from vlm_grpo_ma.task_api.registry import get_task
    from vlm_grpo_ma.tools import evaluate
    from vlm_grpo_ma.tools.warmstart import completion_loss, main

    path, out, start = toy_task("toy_colour"), tmp_path / "warm", str(untrained_tiny_dir)
    limits = ["--max-thought-tokens", "8", "--max-answer-tokens", "8"]
    main(["--task", "toy_colour", "--task-module", str(path), "--model", start, "--out", str(out), "--steps", "20",
          "--batch-size", "4", "--learning-rate", "3e-2", "--eval-samples", "2", "--threads", "1", *limits])  # fmt: skip
    record = json.loads((out / "warmstart.json").read_text())
    assert (record["steps"], record["train_samples"], record["eval_samples"]) == (20, 8, 2)

    task = get_task("toy_colour")
    train = task.load("train")

    def target_loss(model: str) -> float:
        policy = load_policy(model, attn_implementation="sdpa")
        prompts = [encode_prompt(policy, s, task.instruction) for s in train]
        with torch.no_grad():
            return completion_loss(policy, prompts, [task.target(s) for s in train]).item()

    assert target_loss(str(out)) < 0.2 * target_loss(start)

    assert evaluate.main(["--models", start, str(out), "--tasks", "toy_colour", "--task-module", str(path),
                          "--output-dir", str(tmp_path / "eval"), "--no-progress", *limits]) == 0  # fmt: skip
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    before, after = (scores["toy_colour-test"] for scores in results.values())
    assert record["before"] == before and record["after"] == after
    assert after["thought_tokens"] < before["thought_tokens"]  # it learned to end its thought, as its targets do


def test_a_lora_warm_start_writes_the_merged_model(toy_task, tmp_path, untrained_tiny_dir):
    """--lora-rank trains adapters on the decoder and merges them: the folder is a plain model (no adapter
    files) whose decoder weights moved and whose frozen vision tower did not. Planted: the adapter not merged
    before saving; the folder's weights were the base model's (plus unused LoRA tensors). This failed."""
    from safetensors.torch import load_file

    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.tools.warmstart import main

    path, out = toy_task("toy_lora"), tmp_path / "warm"
    main(["--task", "toy_lora", "--task-module", str(path), "--model", str(untrained_tiny_dir), "--out", str(out),
          "--steps", "3", "--batch-size", "2", "--lora-rank", "4", "--eval-samples", "1", "--max-thought-tokens", "2",
          "--max-answer-tokens", "2", "--threads", "1"])  # fmt: skip
    assert json.loads((out / "warmstart.json").read_text())["lora_rank"] == 4
    assert not (out / "adapter_config.json").exists()
    base, warm = load_file(untrained_tiny_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(warm) == set(base)
    moved = {name for name in base if not torch.equal(base[name], warm[name])}
    assert any(".self_attn.q_proj." in name for name in moved) and not any("visual" in name for name in moved)
    assert load_policy(str(out)).adapter is None


def test_a_target_that_fails_skips_its_sample_counted(fresh_registry, capsys):
    """Planted: no try around target(sample); the warm start crashed on the first bad row. This failed."""
    from vlm_grpo_ma.task_api.registry import Sample, Task
    from vlm_grpo_ma.tools.task_warmstart import WarmStartError, task_targets

    def target(sample):  # a: fine; b: no string; c: raises
        return {"a": "<think>x</think><answer>1</answer>", "b": None}[sample.id]

    task = Task(name="bad_targets", load=lambda *a: [], reward=lambda c, s: {"reward": 0.0}, instruction="", target=target)
    samples = [Sample("bad_targets", i, "q", (), "1") for i in ("a", "b", "c")]
    assert [s.id for s, _ in task_targets(task, samples)] == ["a"]
    assert "skipped 2 of 3 training samples whose target failed (first: sample 'b': TypeError" in capsys.readouterr().out
    with pytest.raises(WarmStartError, match="target\\(sample\\) gave no completion for any of its 2 training samples \\(sample .b.: TypeError"):
        task_targets(task, samples[1:])


def test_a_training_image_that_does_not_load_is_skipped_for_the_rest_of_the_warm_start(tiny_policy, tmp_path, capsys):
    """Planted: no except around encode_prompt; the first batch raised ImageLoadError. This failed."""
    from PIL import Image

    from vlm_grpo_ma.task_api.registry import Sample, Task
    from vlm_grpo_ma.tools.task_warmstart import TargetBatches, WarmStartError

    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "fine.png")
    task = Task(name="t", load=lambda *a: [], reward=lambda c, s: {"reward": 0.0}, instruction="")
    fine, broken = (Sample("t", name, "q", (str(tmp_path / f"{name}.png"),), "1") for name in ("fine", "missing"))
    batches = TargetBatches(tiny_policy, task, [(fine, "a"), (broken, "b")], batch_size=3, seed=0)
    prompts, texts, _ = batches.take()
    assert texts == ["a", "a", "a"] and len(prompts) == 3 and batches.broken == {"missing"}
    assert capsys.readouterr().out.count("skipping training sample 'missing'") == 1
    with pytest.raises(WarmStartError, match="no training sample's image or video could be read"):
        TargetBatches(tiny_policy, task, [(broken, "b")], batch_size=1, seed=0).take()


@pytest.mark.parametrize("program", ["warmstart", "evaluate"])
def test_a_task_module_that_is_not_on_the_path_is_one_line(program, tmp_path, capsys):
    """Planted: ImportError not caught; a traceback. This failed (for each program)."""
    from vlm_grpo_ma.tools import evaluate, warmstart

    argv = ["--task-module", "no_such_task_module_here", "--out" if program == "warmstart" else "--output-dir", str(tmp_path / "x")]
    with pytest.raises(SystemExit) if program == "warmstart" else contextlib.nullcontext():
        code = {"warmstart": warmstart.main, "evaluate": evaluate.main}[program](argv)
        assert code == 2
    error = capsys.readouterr().err
    assert "--task-module: No module named 'no_such_task_module_here'" in error and error.count("\n") == 1
