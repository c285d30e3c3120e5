"""The warm start's pieces: the per-token targets of the vision phase, the scene stream, one step of each phase."""

from __future__ import annotations

import re

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
