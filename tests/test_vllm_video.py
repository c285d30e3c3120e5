"""The vLLM engine samples prompts that hold videos (docs/VLLM.md, "Video"): the same frames, metadata and prompt as
the HF path (``prompts.encode_prompt``), so its log-probs are the trainer's. Needs ``scripts/setup.sh --vllm``;
skipped without it (failed under VLM_GRPO_MA_REQUIRE_VLLM=1, as tests/test_engines.py's)."""

import pytest
from PIL import Image
from test_engines import _needs_vllm
from video_clips import write_clip

from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
from vlm_grpo_ma.model.loading import load_policy
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.task_api.registry import Sample
from vlm_grpo_ma.task_api.videos import VideoLoadError
from vlm_grpo_ma.tools.bench_engines import logprob_gaps

K, M = 2, 2


@pytest.mark.vllm
def test_vllm_samples_video_prompts_with_the_trainers_inputs_and_logprobs(untrained_tiny_dir, tmp_path):
    """Two prompts (a video; a video and an image), K=2 x M=2: vLLM expands the prompt to the trainer's processor
    ids (the same number of video placeholders), its log-probs are the trainer's forward of the same tokens
    (frames, their order and their time positions are the trainer's: the gap bound of the image tests), stage 2
    hits the prefix cache, and a video that does not decode raises VideoLoadError before the engine is called.
    Measured: 110 sampled tokens, gap max 9.5e-7, hit rate 0.63. Planted: the frames reversed (gap 2.7e-2), the
    metadata's fps halved (second_per_grid_ts doubled: gap 1.3e-3), the trainer's positions after a video left
    where transformers 5.25 puts them (``prompts.text_after_video_positions`` skipped: gap 6.9e-3; vLLM's own
    positions follow Qwen's rule, an implementation independent of ours), the video limit left at 0 (vLLM
    refuses the request: "At most 0 video(s) may be provided in one prompt")."""
    _needs_vllm()
    from vlm_grpo_ma.engines.vllm import VLLMEngine

    policy = load_policy(str(untrained_tiny_dir))
    clip = str(write_clip(tmp_path / "clip.mp4", frames=12, fps=4))  # 3 s at 4 fps: 6 frames sampled at 2 fps
    image = Image.new("RGB", (168, 112), (30, 200, 40))
    samples = [
        Sample("grounding", "video", "What moves in the clip?", (), [0, 0, 1, 1], videos=(clip,)),
        Sample("grounding", "both", "Where does it go?", (image,), [0, 0, 1, 1], videos=(clip,)),
    ]
    prompts = [encode_prompt(policy, s, "Think.") for s in samples]
    assert all(p.video_grid_thw.shape[0] == 1 for p in prompts) and prompts[1].image_grid_thw.shape[0] == 1
    engine = VLLMEngine(str(untrained_tiny_dir), dtype="float32", seed=0, max_images=1, max_videos=1)
    settings = SamplingSettings(temperature=1.0, max_thought_tokens=12, max_answer_tokens=6, thought_stop="e",
                                generators=prompt_generators(3, 0, len(samples)))  # fmt: skip
    engine.step_metrics()
    tree = engine.sample_tree(policy, samples, prompts, num_thoughts=K, num_answers=M, settings=settings)
    assert len(tree.thought_ids) == 2 * K and len(tree.answer_ids) == 2 * K * M
    assert tree.vision_images_encoded == 3  # two videos and an image
    gaps = logprob_gaps(policy, prompts, tree, K, M)
    hit_rate = engine.step_metrics()["rollout/prefix_cache_hit_rate"]
    print(
        f"video tree: {gaps.numel()} tokens, log-prob gap max {float(gaps.max()):.2e}, hit rate {hit_rate:.3f}"
    )
    assert gaps.numel() > 0 and float(gaps.max()) < 1e-4, float(gaps.max())
    assert hit_rate > 0.3

    # vLLM's own expansion of the prompt (placeholders and all) is the trainer's processor's, token for token
    # (stage 1 also checks it, and raises if not)
    from vllm import SamplingParams

    from vlm_grpo_ma.engines.vllm import VIDEO_PROCESSOR_KWARGS, unexpanded_ids, video_item
    from vlm_grpo_ma.task_api.videos import decode_video

    request = {
        "prompt_token_ids": unexpanded_ids(prompts[1].input_ids, policy.image_token_id, policy.video_token_id),
        "multi_modal_data": {"image": [image], "video": [video_item(decode_video(clip, policy.video_budget, factor=policy.patch_factor))]},
        "mm_processor_kwargs": VIDEO_PROCESSOR_KWARGS,
    }  # fmt: skip
    (output,) = engine.llm.generate([request], SamplingParams(max_tokens=1), use_tqdm=False)
    assert list(output.prompt_token_ids) == prompts[1].input_ids
    video_pads = sum(token == policy.video_token_id for token in prompts[1].input_ids)
    assert video_pads == int(prompts[1].video_grid_thw.prod()) // 4 > 1

    # a video that does not decode: VideoLoadError before vLLM is asked anything (the trainer skips the sample)
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    broken = Sample(
        "grounding", "broken", "What moves?", (), [0, 0, 1, 1], videos=(str(tmp_path / "broken.mp4"),)
    )
    asked = []
    engine.llm.generate = lambda *args, **kwargs: asked.append(args)
    with pytest.raises(VideoLoadError, match="broken.mp4"):
        engine.sample_tree(
            policy, [samples[0], broken], prompts[:1] * 2, num_thoughts=K, num_answers=M, settings=settings
        )
    assert not asked
    del engine.llm.generate
