"""The policy code on Qwen2-VL, Qwen3-VL and Qwen3.5 (hybrid: Gated DeltaNet linear attention in 3 of 4
layers, whose cache is a conv state and a recurrent state), not only Qwen2.5-VL.

For each family a tiny randomly initialised model of the real class (real vision tower, real processor, the
project's tokenizer) is saved and loaded through ``load_policy``; then tree sampling with KV-cache branching
is checked against a full re-encode by ``sequence_logprobs`` (vision features shared per prompt, Qwen3-VL's
deepstack features included), the vision tower is checked to run once, and the coordinate frame is checked.
"""

import dataclasses

import pytest
import torch
from PIL import Image
from reencode_check import branched_vs_reencoded
from tiny_families import BUILDERS, _build_qwen3_5
from video_clips import write_clip

from vlm_grpo_ma.engines.decode import SamplingSettings, sample_tree
from vlm_grpo_ma.model.loading import load_policy
from vlm_grpo_ma.model.logprobs import sequence_logprobs, shared_prefix_logprobs
from vlm_grpo_ma.model.prompts import _encode_images, _select_vision_rows, encode_prompt
from vlm_grpo_ma.model.tiny import build_tokenizer
from vlm_grpo_ma.task_api.coords import CoordinateFrame
from vlm_grpo_ma.task_api.registry import Sample

FAMILIES = ["qwen2_vl", "qwen3_vl", "qwen3_5"]
# Qwen3.5's decay parameters (A_log, dt_bias, in_proj_a): their gradients are small sums of many cancelling
# terms, so fp32 rounding moves them by up to 1% of their largest entry while the whole gradient stays within
# 3e-7 (the same comparison run in float64, with the delta rule's fp32 casts lifted, gives 3e-7 on them)
DECAY_PATH = (".A_log", ".dt_bias", ".in_proj_a.")
@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module", params=FAMILIES)
def family_policy(request, tokenizer, tmp_path_factory):
    family = request.param
    torch.manual_seed(0)
    model, processor = BUILDERS[family](tokenizer)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    processor.save_pretrained(path)
    model.save_pretrained(path)
    policy = load_policy(str(path), attn_implementation="sdpa")
    policy.model.eval()
    return family, policy


def _samples(n):
    # different question lengths -> different prompt lengths -> left padding in the prefill
    colours = [(220, 30, 30), (30, 200, 40), (40, 40, 220)]
    sizes = [(168, 112), (112, 140), (128, 128)]  # different images -> different vision token counts
    return [
        Sample("grounding", str(i), "Locate: the red circle" + " please" * (2 * i), (Image.new("RGB", sizes[i], colours[i]),), [0, 0, 1, 1])
        for i in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return [write_clip(folder / "eight.mp4", frames=8, fps=4), write_clip(folder / "twelve.mp4", frames=12, fps=8)]


def _video_samples(clips):
    """A video alone, an image and a video, an image alone: every mix of the modalities in one batch."""
    image_samples = _samples(3)
    return [
        dataclasses.replace(image_samples[0], images=(), videos=(str(clips[0]),)),
        dataclasses.replace(image_samples[1], videos=(str(clips[1]),)),
        image_samples[2],
    ]


def _settings(seed=0):
    # thought_stop "e" makes untrained-model thoughts stop at uneven lengths (a real "</think>" is rare)
    torch.manual_seed(seed)  # these settings sample from the global generator
    return SamplingSettings(temperature=1.0, max_thought_tokens=14, max_answer_tokens=8, thought_stop="e")


def test_loads_the_real_class_with_relative_frame(family_policy):
    family, policy = family_policy
    assert policy.model.config.model_type == family
    expected = {
        "qwen2_vl": "Qwen2VLForConditionalGeneration",
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
    }
    assert type(policy.model).__name__ == expected[family]
    assert policy.frame is CoordinateFrame.RELATIVE_1000
    assert sum(p.numel() for p in policy.model.parameters()) < 1_000_000


def test_processor_expands_the_image_placeholder(family_policy):
    family, policy = family_policy
    prompt = encode_prompt(policy, _samples(1)[0], "Think.")
    merge = policy.model.config.vision_config.spatial_merge_size
    ((t, h, w),) = prompt.image_grid_thw.tolist()
    assert prompt.input_ids.count(policy.image_token_id) == t * h * w // merge**2 > 1
    patch = {"qwen2_vl": 14, "qwen3_vl": 16, "qwen3_5": 16}[family]
    width, height = prompt.input_sizes[0]
    assert (width, height) == (w * patch, h * patch)
    assert width % (patch * merge) == 0 and height % (patch * merge) == 0


@pytest.mark.parametrize("num_prompts, num_thoughts, media", [(3, 2, "images"), (2, 3, "images"), (3, 2, "videos")])
def test_branched_answer_logprobs_equal_full_reencode(family_policy, clips, num_prompts, num_thoughts, media):
    family, policy = family_policy
    m = 2
    samples = _samples(num_prompts) if media == "images" else _video_samples(clips)[:num_prompts]
    prompts = [encode_prompt(policy, s, "Think.") for s in samples]
    assert len({len(p.input_ids) for p in prompts}) == num_prompts
    tree = sample_tree(policy, prompts, num_thoughts=num_thoughts, num_answers=m, settings=_settings())
    assert len(tree.answer_ids) == num_prompts * num_thoughts * m
    assert len({len(t) for t in tree.thought_ids}) >= 2, "test needs uneven thoughts"
    worst, compared = branched_vs_reencoded(policy, prompts, tree, num_thoughts, m)
    print(f"{family} B={num_prompts} K={num_thoughts} M={m}: max |diff| {worst:.3g} over {compared} tokens")
    assert compared > 0
    assert worst <= 1e-4


def test_vision_tower_runs_once_for_all_prompts(family_policy):
    _, policy = family_policy
    images_seen = []

    def hook(module, args, kwargs):
        images_seen.append(kwargs["grid_thw"].shape[0] if "grid_thw" in kwargs else args[1].shape[0])

    handle = policy.model.model.visual.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        prompts = [encode_prompt(policy, s, "Think.") for s in _samples(3)]
        tree = sample_tree(policy, prompts, num_thoughts=3, num_answers=2, settings=_settings(seed=1))
    finally:
        handle.remove()
    assert images_seen == [3]  # one call, 3 images, for 18 answers
    assert tree.vision_images_encoded == 3


def test_selected_vision_rows_match_a_per_row_encode(family_policy):
    """Rows that share a prompt get that prompt's features (deepstack levels too for Qwen3-VL), in row order."""
    family, policy = family_policy
    prompts = [encode_prompt(policy, s, "Think.") for s in _samples(3)]
    row_prompt = [2, 0, 0, 1, 2]
    with torch.no_grad():
        shared, _ = _encode_images(policy, prompts)
        selected = _select_vision_rows(shared, prompts, row_prompt)["image"]
        direct, _ = _encode_images(policy, [prompts[p] for p in row_prompt])
        direct = direct["image"]
    assert len(selected.pooler_output) == len(row_prompt)
    for got, want in zip(selected.pooler_output, direct.pooler_output, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    deepstack = getattr(direct, "deepstack_features", None)
    if family == "qwen3_vl":
        assert deepstack, "Qwen3-VL must produce deepstack features"
        assert len(selected.deepstack_features) == len(deepstack)
        for got_level, want_level in zip(selected.deepstack_features, deepstack, strict=True):
            torch.testing.assert_close(
                torch.cat(list(got_level)), torch.cat(list(want_level)), atol=1e-5, rtol=1e-5
            )
    else:
        assert not deepstack


@pytest.mark.parametrize("media", ["images", "videos"])
def test_sequence_logprobs_equal_the_models_own_forward(family_policy, clips, media, monkeypatch):
    """Shared vision features, our mRoPE positions and right padding give the log-probs of the model's own
    forward (pixel_values and pixel_values_videos in, positions, video time positions and Qwen3-VL deepstack
    injection computed by transformers), row by row."""
    import vlm_grpo_ma.model.logprobs as logprobs_module

    family, policy = family_policy
    samples = _samples(3) if media == "images" else _video_samples(clips)
    prompts = [encode_prompt(policy, s, "Think.") for s in samples]
    words = ["the red circle is at the top", "left", "the blue square"]
    row_prompt = [2, 0, 1, 0]
    completions = [
        policy.tokenizer.encode(words[r % 3], add_special_tokens=False) for r in range(len(row_prompt))
    ]
    with torch.no_grad():
        ours = sequence_logprobs(policy, prompts, row_prompt, completions, temperature=1.0)
        worst = 0.0
        # Qwen3.5: the reference is transformers' own Gated DeltaNet forward, not the masked one the policy runs
        _restore_transformers_layers(policy.model, monkeypatch)
        for r, (p, completion) in enumerate(zip(row_prompt, completions, strict=True)):
            ids = torch.tensor([prompts[p].input_ids + completion])
            policy.model.model.rope_deltas = None
            logits = policy.model(input_ids=ids, **_own_vision_inputs(policy, prompts[p], ids)).logits[0]
            logprobs = logprobs_module._policy_logprobs(logits, 1.0, policy.suppressed_token_ids)
            start = len(prompts[p].input_ids) - 1
            reference = logprobs[start + torch.arange(len(completion)), torch.tensor(completion)]
            worst = max(worst, float((reference - ours[r, : len(completion)]).abs().max()))
        print(f"{family} sequence_logprobs vs the model's own forward: max |diff| {worst:.3g}")
        assert worst <= 1e-4
        if family == "qwen3_vl":  # the comparison would catch deepstack features that get lost
            select = logprobs_module._select_vision_rows

            def without_deepstack(*args):
                selected = select(*args)
                for output in selected.values():
                    output.deepstack_features = [
                        tuple(torch.zeros_like(t) for t in level) for level in output.deepstack_features
                    ]
                return selected

            monkeypatch.setattr(logprobs_module, "_select_vision_rows", without_deepstack)
            dropped = sequence_logprobs(policy, prompts, row_prompt, completions, temperature=1.0)
            assert float((dropped - ours).abs().max()) > 1e-2


def _own_vision_inputs(policy, prompt, ids) -> dict:
    """The model's own image and video arguments for one prompt (transformers computes everything from them)."""
    inputs = {"mm_token_type_ids": (ids == policy.image_token_id).int() + 2 * (ids == policy.video_token_id).int()}
    if prompt.image_grid_thw.shape[0]:
        inputs.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    if prompt.video_grid_thw.shape[0]:
        inputs.update(pixel_values_videos=prompt.pixel_values_videos, video_grid_thw=prompt.video_grid_thw)
        if policy.model.config.model_type == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = prompt.video_seconds_per_grid
    return inputs


def _restore_transformers_layers(model, monkeypatch) -> None:
    """Give each linear-attention layer that ``linear_attention.install`` changed its transformers class back,
    until the test ends."""
    for module in model.modules():
        if type(module).__name__.startswith("Masked"):
            monkeypatch.setattr(module, "__class__", type(module).__bases__[0])


def test_shared_prefix_training_forward_equals_a_full_reencode(family_policy):
    """The training forward through the KV cache (each prompt and thought once, vision features of different
    sizes, Qwen3-VL deepstack) gives the log-probs and gradients of re-encoding each row."""
    family, policy = family_policy
    prompts = [encode_prompt(policy, s, "Think.") for s in _samples(3)]
    tree = sample_tree(policy, prompts, num_thoughts=2, num_answers=2, settings=_settings(seed=2))
    rows = [(a // 2 // 2, tree.thought_ids[a // 2], answer) for a, answer in enumerate(tree.answer_ids)][::-1]
    row_prompt = [p for p, _, _ in rows]
    completions = [thought + answer for _, thought, answer in rows]
    thought_lengths = [len(thought) for _, thought, _ in rows]
    params = [p for p in policy.model.parameters() if p.requires_grad]
    weights = torch.randn((len(rows), max(map(len, completions))), generator=torch.Generator().manual_seed(0))
    shared = shared_prefix_logprobs(policy, prompts, row_prompt, completions, thought_lengths, temperature=1.0)
    full = sequence_logprobs(policy, prompts, row_prompt, completions, temperature=1.0)
    worst = float((shared - full).detach().abs().max())
    print(f"{family} shared-prefix vs re-encoded log-probs: max |diff| {worst:.3g}")
    assert worst <= 1e-4
    names = [name for name, p in policy.model.named_parameters() if p.requires_grad]
    shared_grads = torch.autograd.grad((shared * weights).sum(), params)
    full_grads = torch.autograd.grad((full * weights).sum(), params)
    gap = torch.cat([(a - b).flatten() for a, b in zip(shared_grads, full_grads, strict=True)]).norm()
    relative = float(gap / torch.cat([b.flatten() for b in full_grads]).norm())
    print(f"{family} shared-prefix vs re-encoded gradients: |diff| / |grad| {relative:.3g}")
    assert relative <= 1e-5
    for name, got, want in zip(names, shared_grads, full_grads, strict=True):
        if any(part in name for part in DECAY_PATH):
            continue  # sums of cancelling fp32 terms: in the global bound above
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-8)


def test_lora_on_qwen3_5_adapts_the_linear_attention_layers_and_shares_prefixes(tokenizer, tmp_path, caplog):
    """LoRA on the hybrid model: the linear-attention projections take adapters when named (and a target list
    without them is warned about), and the shared-prefix training forward through adapted Gated DeltaNet layers
    gives the log-probs and adapter gradients of a re-encode."""
    from vlm_grpo_ma.model import lora

    torch.manual_seed(0)
    model, processor = _build_qwen3_5(tokenizer)
    processor.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    attention_and_mlp = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with caplog.at_level("WARNING", logger=lora.__name__):
        lora.apply_lora(load_policy(str(tmp_path)).model, rank=2, alpha=4.0, dropout=0.0, target_modules=attention_and_mlp)
    assert "in_proj_qkv, in_proj_z, out_proj" in caplog.text

    policy = load_policy(str(tmp_path), attn_implementation="sdpa")
    targets = attention_and_mlp + list(lora.LINEAR_ATTENTION_TARGETS)
    policy.adapter = lora.apply_lora(policy.model, rank=2, alpha=4.0, dropout=0.0, target_modules=targets)
    adapted = lora.adapted_module_names(policy.model)
    assert {name.rsplit(".", 1)[-1] for name in adapted if ".linear_attn." in name} == set(lora.LINEAR_ATTENTION_TARGETS)
    generator = torch.Generator().manual_seed(1)
    for name, parameter in policy.model.named_parameters():
        if "lora_B" in name:  # B starts at 0: give the adapters an effect
            parameter.data = 0.1 * torch.randn(parameter.shape, generator=generator)
    policy.model.eval()
    prompts = [encode_prompt(policy, s, "Think.") for s in _samples(2)]
    tree = sample_tree(policy, prompts, num_thoughts=2, num_answers=2, settings=_settings(seed=3))
    row_prompt = [a // 4 for a in range(len(tree.answer_ids))]
    completions = [tree.thought_ids[a // 2] + answer for a, answer in enumerate(tree.answer_ids)]
    thought_lengths = [len(tree.thought_ids[a // 2]) for a in range(len(tree.answer_ids))]
    adapters = [p for name, p in policy.model.named_parameters() if "lora_" in name and ".linear_attn." in name]
    shared = shared_prefix_logprobs(policy, prompts, row_prompt, completions, thought_lengths, temperature=1.0)
    full = sequence_logprobs(policy, prompts, row_prompt, completions, temperature=1.0)
    assert float((shared - full).detach().abs().max()) <= 1e-5
    weights = torch.randn(shared.shape, generator=generator)
    for got, want in zip(torch.autograd.grad((shared * weights).sum(), adapters), torch.autograd.grad((full * weights).sum(), adapters), strict=True):
        assert float(want.abs().max()) > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_qwen3_5_moe_branches_and_shares_the_thought_like_the_dense_model(tmp_path):
    """The MoE class takes the same path: its Gated DeltaNet layers get the masked forward, and both the branched
    sampling log-probs and the shared-prefix training forward equal a re-encode."""
    from tiny_families import save_tiny

    policy = load_policy(str(save_tiny("qwen3_5_moe", tmp_path)), attn_implementation="sdpa")
    policy.model.eval()
    assert type(policy.model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert sum(type(m).__name__.startswith("Masked") for m in policy.model.modules()) == 3
    prompts = [encode_prompt(policy, s, "Think.") for s in _samples(3)]
    tree = sample_tree(policy, prompts, num_thoughts=2, num_answers=2, settings=_settings(seed=2))
    worst, compared = branched_vs_reencoded(policy, prompts, tree, 2, 2)
    assert compared > 0 and worst <= 1e-5
    row_prompt = [a // 4 for a in range(len(tree.answer_ids))]
    completions = [tree.thought_ids[a // 2] + answer for a, answer in enumerate(tree.answer_ids)]
    thought_lengths = [len(tree.thought_ids[a // 2]) for a in range(len(tree.answer_ids))]
    with torch.no_grad():
        shared = shared_prefix_logprobs(policy, prompts, row_prompt, completions, thought_lengths, temperature=1.0)
        full = sequence_logprobs(policy, prompts, row_prompt, completions, temperature=1.0)
    assert float((shared - full).abs().max()) <= 1e-5
