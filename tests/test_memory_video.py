"""The memory model counts a run's video tokens (vlm_grpo_ma.run.memory_model.video_tokens, ``videos_per_prompt``):
each video at the budget's limit adds its tokens to every prompt's sequence (KV cache, decoder activations)
and its patches to a trained vision tower's; data without videos adds nothing. Figures by hand."""

import dataclasses

import pytest

from vlm_grpo_ma.model.architectures import Architecture
from vlm_grpo_ma.run import memory_model
from vlm_grpo_ma.run.config_files import load_config
from vlm_grpo_ma.tools import memory

# tests/test_memory.py's small text model (layer: 208 bytes a token, kv width 2) with Qwen2.5-VL's vision patches:
# 14 pixels, merged 2 x 2, frames in temporal pairs
VIDEO_SMALL = Architecture(
    family="qwen2_5_vl",
    text=dict(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, tie_word_embeddings=True),
    vision=dict(depth=1, hidden_size=2, intermediate_size=3, out_hidden_size=4, in_channels=1, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2),
)  # fmt: skip

# 16 frames of 448 x 448: 16 / 2 temporal patches x (448 x 448) / 28^2 = 8 x 256 tokens
VIDEO_TOKENS = 8 * 256


def _cfg(*overrides):
    return load_config(None, [
        "model.dtype=float32", "model.max_pixels=784", "model.freeze_vision=true", "model.gradient_checkpointing=true",
        "model.video_max_frames=16", f"model.video_max_pixels={448 * 448}",
        "rollout.num_thoughts=2", "rollout.num_answers=3", "rollout.max_thought_tokens=5", "rollout.max_answer_tokens=2",
        "train.prompts_per_step=2", "train.micro_batch_rows=4", *overrides,
    ])  # fmt: skip


def test_video_tokens_by_hand():
    assert memory_model.video_tokens(VIDEO_SMALL, 16, 448 * 448) == VIDEO_TOKENS == 2048
    # decoding samples an even count of frames: a budget of 15 gives 14, 7 temporal patches
    assert memory_model.video_tokens(VIDEO_SMALL, 15, 448 * 448) == 7 * 256


def test_a_video_per_prompt_grows_the_cache_and_the_activations_by_its_tokens():
    """Planted: the video term left out of the prompt's tokens -> both estimates equal, no growth."""
    without = memory_model.estimate(VIDEO_SMALL, _cfg(), 1, "ddp")
    video = memory_model.estimate(VIDEO_SMALL, _cfg(), 1, "ddp", videos_per_prompt=1)
    # KV cache: 2 prompts x (2 x 3 + 2) = 16 rows, each 2048 tokens longer, x 2 layers x (k, v) x kv width 2 x 4 bytes
    assert video.kv_cache - without.kv_cache == 16 * VIDEO_TOKENS * 2 * 2 * 2 * 4
    # activations (checkpointed, 4 rows of micro-batch): per extra token the 2 layers' inputs 2 x 4 rows x 4 x 4
    # bytes = 128, the recomputed layer 4 rows x 208 = 832, its attention's keys and values repeated to 2 heads x
    # 2 dims, 2 x 4 rows x 4 x 4 = 128; the head scores the completion only
    assert video.activations - without.activations == VIDEO_TOKENS * (128 + 832 + 128)
    assert (video.weights, video.gradients, video.optimizer) == (without.weights, without.gradients, without.optimizer)
    # two videos per prompt: twice the growth
    two = memory_model.estimate(VIDEO_SMALL, _cfg(), 1, "ddp", videos_per_prompt=2)
    assert two.kv_cache - without.kv_cache == 2 * (video.kv_cache - without.kv_cache)


def test_a_trained_vision_tower_keeps_the_videos_patches():
    """Its block inputs: 2 distinct prompts x (2048 tokens x 2^2 patches) x width 2 x 4 bytes x depth 1, on top of
    the decoder's growth."""
    cfg = _cfg("model.freeze_vision=false")
    without = memory_model.estimate(VIDEO_SMALL, cfg, 1, "ddp")
    video = memory_model.estimate(VIDEO_SMALL, cfg, 1, "ddp", videos_per_prompt=1)
    assert video.activations - without.activations == VIDEO_TOKENS * (128 + 832 + 128) + 2 * VIDEO_TOKENS * 4 * 2 * 4 * 1


def test_no_videos_changes_nothing_whatever_the_budget():
    default = memory_model.estimate(VIDEO_SMALL, _cfg(), 1, "ddp")
    assert memory_model.estimate(VIDEO_SMALL, _cfg(), 1, "ddp", videos_per_prompt=0) == default
    larger = _cfg("model.video_max_frames=64", f"model.video_max_pixels={1024 * 1024}")
    assert memory_model.estimate(VIDEO_SMALL, larger, 1, "ddp") == default
    with pytest.raises(ValueError, match="videos_per_prompt -1: must be >= 0"):
        memory_model.estimate(VIDEO_SMALL, _cfg(), 1, "ddp", videos_per_prompt=-1)


def test_the_start_check_counts_the_videos():
    """A GPU that holds the video run's 2 x 1 tree exactly: the 2 x 3 tree fits without videos, not with one
    (micro-batches of a whole step's rows, so that the update's peak grows with the tree too)."""
    cfg = _cfg("train.micro_batch_rows=12")
    smallest_with_video = memory_model.estimate(
        VIDEO_SMALL, dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_answers=1)), 1, "ddp", videos_per_prompt=1
    ).peak
    assert memory_model.tree_too_large(VIDEO_SMALL, cfg, 1, "ddp", smallest_with_video) is None
    problem = memory_model.tree_too_large(VIDEO_SMALL, cfg, 1, "ddp", smallest_with_video, videos_per_prompt=1)
    assert problem is not None and "at most rollout.num_answers=1 fits" in problem


def test_the_memory_command_takes_videos_per_prompt(capsys):
    preset = str(memory.REPO / "configs/qwen2.5-vl-3b-lora-grounding-t4a4.yaml")
    assert memory.main(["--config", preset]) == 0
    plain = capsys.readouterr().out
    assert memory.main(["--config", preset, "--videos-per-prompt", "1", "model.video_max_frames=16",
                        f"model.video_max_pixels={448 * 448}"]) == 0  # fmt: skip
    video = capsys.readouterr().out
    assert "1 video(s) per prompt, 2,048 tokens each" in video and "video(s) per prompt" not in plain

    def peak(out: str) -> int:
        (line,) = [line for line in out.splitlines() if line.strip().startswith("peak ")]
        return int(line.split()[1].replace(",", ""))

    assert peak(video) > peak(plain)
    assert memory.main(["--config", preset, "--videos-per-prompt", "-1"]) == 2
    assert "--videos-per-prompt=-1 must be >= 0" in capsys.readouterr().err
