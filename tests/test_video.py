"""Videos through the model layer on the embedded Qwen2.5-VL: decoding under the budget (frames in time order,
qwen-vl-utils' counts and sizes, bad files refused by name), time positions, and a broken video skipped and
counted in a step's draw. The other families' video prompts are checked in test_model_families.py."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter

import av
import pytest
import torch
from PIL import Image
from video_clips import STEP, frame_array, square_column, write_clip

from vlm_grpo_ma.model.loading import load_policy
from vlm_grpo_ma.model.logprobs import sequence_logprobs
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.run.loop import draw_prompts
from vlm_grpo_ma.task_api.registry import Sample
from vlm_grpo_ma.task_api.streams import PromptStream
from vlm_grpo_ma.task_api.videos import VideoBudget, VideoLoadError, decode_video


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("clips")


@pytest.fixture(scope="module")
def policy():
    loaded = load_policy("tiny", attn_implementation="sdpa")
    loaded.model.eval()
    return loaded


def test_frames_come_in_time_order_at_the_budgets_rate(clip_dir):
    """16 frames at 8 fps, sampled at 2 fps: 4 frames, the 0th, 5th, 10th and 15th (qwen-vl-utils' count, evenly
    spread), each showing the square where that source frame has it. Planted: the decoded frames reversed
    (columns decreasing) and a chosen index off by one (the square one STEP away); both failed here."""
    path = write_clip(clip_dir / "sixteen.mp4", frames=16, fps=8)
    video = decode_video(str(path), VideoBudget(fps=2.0, max_frames=16, max_pixels=56 * 56))
    assert video.frame_indices == [0, 5, 10, 15]
    assert video.total_frames == 16 and video.source_fps == 8.0 and video.sampled_fps == 2.0
    assert tuple(video.frames.shape) == (4, 3, 56, 56) and video.frames.dtype == torch.uint8
    for frame, index in zip(video.frames, video.frame_indices, strict=True):
        assert square_column(frame) == pytest.approx(2 + STEP * index, abs=1)
    assert video.cut == ""


def test_a_list_of_frames_is_a_video_at_the_budgets_rate(clip_dir):
    frames = [Image.fromarray(frame_array(i)) for i in range(6)]
    video = decode_video(frames, VideoBudget(fps=2.0, max_frames=4, max_pixels=56 * 56))
    assert video.frame_indices == [0, 2, 3, 5]  # 6 frames over a budget of 4: evenly
    assert [square_column(f) for f in video.frames] == pytest.approx([2 + STEP * i for i in (0, 2, 3, 5)], abs=1)
    assert "exceed model.video_max_frames=4" in video.cut


def test_a_video_past_the_budget_is_cut_down_and_said_once(clip_dir, caplog):
    """40 frames at 8 fps, 320x240: 10 frames at 2 fps exceed max_frames 6 (6 sampled evenly, all in order), and
    the frames are resized to within max_pixels with sides multiples of 28. The cut is logged once however
    often the video is decoded."""
    path = write_clip(clip_dir / "long.mp4", frames=40, fps=8, width=320, height=240)
    budget = VideoBudget(fps=2.0, max_frames=6, max_pixels=112 * 84)
    with caplog.at_level(logging.INFO, logger="vlm_grpo_ma.task_api.videos"):
        first = decode_video(str(path), budget)
        decode_video(str(path), budget)
    assert len(first.frame_indices) == 6 and first.frame_indices == sorted(first.frame_indices)
    height, width = first.frames.shape[-2:]
    assert height * width <= budget.max_pixels and height % 28 == 0 and width % 28 == 0
    assert "model.video_max_frames=6" in first.cut and "model.video_max_pixels=9408" in first.cut
    said = [r.message for r in caplog.records if "cut down to the budget" in r.message]
    assert len(said) == 1 and str(path) in said[0]


def _bad_videos(folder):
    empty = folder / "empty.mp4"
    empty.write_bytes(b"")
    corrupt = folder / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    truncated = folder / "truncated.mp4"
    truncated.write_bytes(write_clip(folder / "whole.mp4", frames=8).read_bytes()[:300])
    not_a_video = folder / "picture.mp4"
    Image.new("RGB", (8, 8)).save(not_a_video, format="PNG")
    no_frames = folder / "no-frames.mkv"
    with av.open(str(no_frames), "w") as container:  # a video stream in a written header, never a frame
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        container.start_encoding()
    return {"missing": str(folder / "absent.mp4"), "empty": str(empty), "corrupt": str(corrupt),
            "truncated": str(truncated), "a still picture": str(not_a_video), "a stream of no frames": str(no_frames),
            "an empty frame list": [],
            "a broken frame": [Image.new("RGB", (8, 8)), str(folder / "absent.png")]}  # fmt: skip


def test_bad_videos_raise_a_video_load_error_naming_them(clip_dir):
    budget = VideoBudget()
    for what, video in _bad_videos(clip_dir).items():
        if isinstance(video, str) and what != "missing":
            assert os.path.getsize(video) > 0 or what == "empty", what  # each file is there, as described
        with pytest.raises(VideoLoadError) as error:
            decode_video(video, budget)
        name = video if isinstance(video, str) else "frames"
        assert name in str(error.value), (what, str(error.value))


def test_a_broken_video_is_skipped_and_counted_in_a_steps_draw(policy, clip_dir):
    good = write_clip(clip_dir / "good.mp4", frames=8)
    bad = _bad_videos(clip_dir)
    samples = [Sample("video", f"s{i}", "Which way?", (), "A", videos=(str(good),)) for i in range(4)]
    samples[1] = dataclasses.replace(samples[1], videos=(bad["corrupt"],))
    samples[2] = dataclasses.replace(samples[2], videos=(bad["missing"],))
    order = [s.id for s in PromptStream(samples, seed=0).take(4)]
    counters = Counter()
    drawn, prompts = draw_prompts(PromptStream(samples, seed=0), 2, lambda s: encode_prompt(policy, s, "Think."), counters)
    assert [s.id for s in drawn] == [i for i in order if i in ("s0", "s3")]
    assert counters == {"skipped_broken_videos": 2}
    assert all(p.video_grid_thw.shape[0] == 1 for p in prompts)


def test_positions_follow_qwens_rule_for_videos(policy):
    """Hand-computed on the embedded Qwen2.5-VL (tokens_per_second 4): 2 text tokens, a video of 3 temporal
    patches 0.5 s apart (time step 4 x 0.5 = 2) of 2x2 merged tokens, 2 text tokens, an image of 2x2, 1 text
    token. Qwen's rule (its reference code, vLLM): the video at t = 2, 4, 6, h and w 2..3; the text after it at
    its largest position + 1 = 7, 8; the image at 9 (h, w 9..10); the last token at 11. Planted: the text after
    the video where transformers 5.25 puts it (text_after_video_positions skipped: 4, 5, the image at 6) and the
    video's time spacing dropped (second_per_grid_ts not passed: t = 2, 6, 10); both failed here."""
    from vlm_grpo_ma.model.prompts import VisionGrids, _rope_positions

    text, video, image = 7, policy.video_token_id, policy.image_token_id
    ids = torch.tensor([[text, text] + [video] * 12 + [text, text] + [image] * 4 + [text]])
    grids = VisionGrids(image=torch.tensor([[1, 4, 4]]), video=torch.tensor([[3, 4, 4]]), video_seconds=torch.tensor([0.5]))
    positions = _rope_positions(policy, ids, torch.ones_like(ids), grids)[:, 0]
    t_video = [2] * 4 + [4] * 4 + [6] * 4
    h_video = [2, 2, 3, 3] * 3
    w_video = [2, 3, 2, 3] * 3
    expected = torch.tensor([
        [0, 1, *t_video, 7, 8, 9, 9, 9, 9, 11],
        [0, 1, *h_video, 7, 8, 9, 9, 10, 10, 11],
        [0, 1, *w_video, 7, 8, 9, 10, 9, 10, 11],
    ])  # fmt: skip
    assert positions.tolist() == expected.tolist()
    # left padding moves nothing: the padded row's real tokens get the same positions
    padded = torch.cat([torch.zeros((1, 3), dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros((1, 3), dtype=torch.long), torch.ones_like(ids)], dim=1)
    assert _rope_positions(policy, padded, mask, grids)[:, 0, 3:].tolist() == expected.tolist()


def test_video_logprobs_equal_the_models_own_forward_at_those_positions(policy, clip_dir):
    """A real clip (16 frames at 8 fps, sampled at 4 fps: 0.5 s a patch): sequence_logprobs equals the model's
    own forward given the video's pixels, grid and the positions above (what the features are and where they
    go is the model's; the positions are the test above's). Planted: the video's pixel rows reversed on their way
    to the vision tower (0.39 off)."""
    from vlm_grpo_ma.model.prompts import VisionGrids, _rope_positions

    path = write_clip(clip_dir / "fast.mp4", frames=16, fps=8)
    policy.video_budget = VideoBudget(fps=4.0, max_frames=16, max_pixels=56 * 56)
    try:
        sample = Sample("video", "v", "Which way does it move?", (), "A", videos=(str(path),))
        prompt = encode_prompt(policy, sample, "Think.")
    finally:
        policy.video_budget = VideoBudget()
    assert prompt.video_frames == (8,) and prompt.video_grid_thw.tolist() == [[4, 4, 4]]
    assert prompt.video_seconds_per_grid.tolist() == [0.5]
    completion = policy.tokenizer.encode("the square moves right", add_special_tokens=False)
    ids = torch.tensor([prompt.input_ids + completion])
    with torch.no_grad():
        ours = sequence_logprobs(policy, [prompt], [0], [completion], temperature=1.0)[0]
        positions = _rope_positions(policy, ids, torch.ones_like(ids), VisionGrids.of([prompt]))
        logits = policy.model(
            input_ids=ids, position_ids=positions, pixel_values_videos=prompt.pixel_values_videos,
            video_grid_thw=prompt.video_grid_thw, second_per_grid_ts=prompt.video_seconds_per_grid,
            mm_token_type_ids=2 * (ids == policy.video_token_id).int(),
        ).logits[0]  # fmt: skip
        reference = torch.log_softmax(logits.float(), -1)
        for token in policy.suppressed_token_ids:  # the policy never samples vision placeholders
            reference[:, token] = float("-inf")
        reference = torch.log_softmax(reference, -1)
        start = len(prompt.input_ids) - 1
        reference = reference[start + torch.arange(len(completion)), torch.tensor(completion)]
    assert float((reference - ours).abs().max()) <= 1e-5
