"""Tree sampling against a full re-encode, vision-tower call counts, and the K x M structure."""

import pytest
import torch
from PIL import Image
from reencode_check import branched_vs_reencoded

from vlm_grpo_ma.engines.decode import SamplingSettings, sample_tree
from vlm_grpo_ma.engines.rollout import generate_rollout
from vlm_grpo_ma.model.loading import coordinate_frame_for
from vlm_grpo_ma.model.logprobs import sequence_logprobs
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.task_api.coords import CoordinateFrame
from vlm_grpo_ma.task_api.registry import Sample


def _samples(n):
    # Different question lengths -> different prompt lengths -> left padding in the prefill.
    colours = [(220, 30, 30), (30, 200, 40), (40, 40, 220), (230, 210, 20)]
    return [
        Sample("grounding", str(i), "Locate: the red circle" + " please" * i, (Image.new("RGB", (168, 112), colours[i]),), [0, 0, 1, 1])
        for i in range(n)
    ]


def _settings(seed=0, **overrides):
    # thought_stop "e" makes untrained-model thoughts stop at uneven lengths (a real "</think>" is rare)
    torch.manual_seed(seed)  # these settings sample from the global generator
    values = dict(temperature=1.0, max_thought_tokens=14, max_answer_tokens=8, thought_stop="e")
    values.update(overrides)
    return SamplingSettings(**values)


def test_branched_answer_logprobs_equal_full_reencode(tiny_policy):
    k, m = 3, 2
    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(3)]
    tree = sample_tree(tiny_policy, prompts, num_thoughts=k, num_answers=m, settings=_settings())
    thought_lengths = {len(t) for t in tree.thought_ids}
    assert len(thought_lengths) >= 3, f"test needs uneven thoughts, got lengths {thought_lengths}"
    worst, compared = branched_vs_reencoded(tiny_policy, prompts, tree, k, m)
    assert compared > 0
    assert worst <= 1e-4


def test_reencode_check_can_fail(tiny_policy):
    """The comparison above detects a one-position shift of the answer (what padded cache slots would cause)."""
    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(2)]
    tree = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=2, settings=_settings(seed=1))
    a = next(i for i, ans in enumerate(tree.answer_ids) if len(ans) >= 3)
    t = a // 2
    shifted = tree.thought_ids[t] + [tiny_policy.pad_token_id] + tree.answer_ids[a]
    with torch.no_grad():
        lp = sequence_logprobs(tiny_policy, prompts, [t // 2], [shifted], temperature=1.0)
    n = len(tree.thought_ids[t]) + 1
    diffs = [abs(tree.answer_logprobs[a][j] - float(lp[0, n + j])) for j in range(len(tree.answer_ids[a]))]
    assert max(diffs) > 1e-3


def test_vision_tower_runs_once_per_prompt(tiny_policy):
    images_seen = []
    calls = []

    def hook(module, args, kwargs):
        calls.append(1)
        images_seen.append(kwargs["grid_thw"].shape[0] if "grid_thw" in kwargs else args[1].shape[0])

    handle = tiny_policy.model.model.visual.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(3)]
        sample_tree(tiny_policy, prompts, num_thoughts=4, num_answers=4, settings=_settings())
    finally:
        handle.remove()
    assert calls == [1]
    assert images_seen == [3]  # 3 prompts, 48 answers: each image encoded once


def test_rollout_indices_are_explicit(tiny_policy):
    samples = _samples(2)
    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in samples]
    rollout = generate_rollout(tiny_policy, samples, prompts, num_thoughts=3, num_answers=2, settings=_settings())
    assert len(rollout.completions) == 12
    seen = set()
    for a in range(12):
        b, k, m = rollout.indices(a)
        assert rollout.answer_row(b, k, m) == a
        seen.add((b, k, m))
        # every answer of a thought carries that thought's text
        assert rollout.completions[a].thought == rollout.completions[rollout.answer_row(b, k, 0)].thought
        assert rollout.completions[a].input_sizes == prompts[b].input_sizes
    assert seen == {(b, k, m) for b in range(2) for k in range(3) for m in range(2)}


def test_truncated_thoughts_are_closed_by_forced_tokens(tiny_policy):
    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(2)]
    settings = _settings(thought_stop="</think>", max_thought_tokens=6)
    tree = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=1, settings=settings)
    close = tiny_policy.tokenizer.encode("</think>", add_special_tokens=False)
    for ids, forced, truncated, ended in zip(tree.thought_ids, tree.thought_forced, tree.thought_truncated, tree.thought_ended_turn, strict=False):
        assert len(ids) <= 6
        if truncated:
            assert ids[-len(close):] == close and forced[-len(close):] == [True] * len(close)
        else:
            assert not any(forced)
            assert ended or "</think>" in tiny_policy.tokenizer.decode(ids)


def test_vision_placeholder_tokens_are_never_sampled(tiny_policy):
    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(2)]
    suppressed = set(tiny_policy.suppressed_token_ids)
    assert tiny_policy.image_token_id in suppressed
    # a temperature this high makes the distribution nearly uniform: without suppression these would appear
    tree = sample_tree(tiny_policy, prompts, num_thoughts=4, num_answers=4, settings=_settings(temperature=50.0, max_thought_tokens=30, thought_stop="</think>"))
    sampled = {tok for ids in tree.thought_ids + tree.answer_ids for tok in ids}
    assert not sampled & suppressed


def test_same_generator_seed_gives_same_tree(tiny_policy):
    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(2)]
    a = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=2, settings=_settings(seed=5))
    b = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=2, settings=_settings(seed=5))
    assert a.thought_ids == b.thought_ids and a.answer_ids == b.answer_ids


@pytest.mark.parametrize(
    "model_type, frame",
    [
        ("qwen2_5_vl", CoordinateFrame.ABSOLUTE_INPUT),
        ("qwen2_vl", CoordinateFrame.RELATIVE_1000),
        ("qwen3_vl", CoordinateFrame.RELATIVE_1000),
        ("qwen3_5", CoordinateFrame.RELATIVE_1000),
        ("qwen3_5_moe", CoordinateFrame.RELATIVE_1000),
    ],
)
def test_coordinate_frame_by_model_family(model_type, frame):
    assert coordinate_frame_for(model_type) is frame


def test_unknown_model_family_names_the_supported_ones():
    with pytest.raises(ValueError, match="qwen2_5_vl"):
        coordinate_frame_for("llava")


def test_a_template_that_opens_the_thought_leaves_the_tags_to_the_model(tiny_policy, monkeypatch):
    """Thinking models' templates (Qwen3.5) end the generation prompt with "<think>\\n": the prompt is the
    same as on a template that does not, so the completion the tasks score holds both tags."""
    sample = Sample("grounding", "0", "Locate: the red circle", (Image.new("RGB", (56, 56), (200, 30, 30)),), [0, 0, 1, 1])
    plain = encode_prompt(tiny_policy, sample, "Think.").input_ids
    template = tiny_policy.processor.chat_template
    opening = template.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
    assert opening != template
    monkeypatch.setattr(tiny_policy.processor, "chat_template", opening)
    assert tiny_policy.tokenizer.decode(plain).endswith("<|im_start|>assistant\n")
    assert encode_prompt(tiny_policy, sample, "Think.").input_ids == plain


def test_input_sizes_follow_the_resized_image(tiny_policy):
    prompt = encode_prompt(tiny_policy, _samples(1)[0], "Think.")
    width, height = prompt.input_sizes[0]
    assert width % 28 == 0 and height % 28 == 0
    assert prompt.original_sizes[0] == (168, 112)


@pytest.mark.parametrize("with_image", [(False, False), (True, False), (False, True, True)], ids=["text-only", "mixed", "mixed-2"])
def test_prompts_without_images_branch_like_image_prompts(tiny_policy, with_image):
    """Text-only prompts (math word problems, code) and batches mixing them with image prompts: the tree's
    log-probs equal a full re-encode, and only the images that exist reach the vision tower."""
    image_samples = _samples(len(with_image))
    samples = [
        s if has_image else Sample("math", s.id, "What is 3 plus 4?" + " now" * i, (), "7")
        for i, (s, has_image) in enumerate(zip(image_samples, with_image, strict=True))
    ]
    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in samples]
    assert [p.image_grid_thw.shape[0] for p in prompts] == [int(h) for h in with_image]
    tree = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=2, settings=_settings(seed=3))
    assert tree.vision_images_encoded == sum(with_image)
    worst, compared = branched_vs_reencoded(tiny_policy, prompts, tree, 2, 2)
    assert compared > 0
    assert worst <= 1e-4


def test_a_prompts_tree_does_not_depend_on_its_batch(tiny_policy):
    """Per-prompt generators: prompts 2 and 3 sample the same trees alone as in a batch of four (what lets a
    run split over processes sample what a one-process run samples)."""
    from vlm_grpo_ma.engines.decode import prompt_generators

    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(4)]
    settings = dict(max_thought_tokens=10, max_answer_tokens=6)
    whole = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=2,
                        settings=SamplingSettings(**settings, generators=prompt_generators(7, 0, 4)))
    part = sample_tree(tiny_policy, prompts[2:], num_thoughts=2, num_answers=2,
                       settings=SamplingSettings(**settings, generators=prompt_generators(7, 2, 2)))
    assert whole.thought_ids[4:] == part.thought_ids
    assert whole.answer_ids[8:] == part.answer_ids
    other_seed = sample_tree(tiny_policy, prompts[2:], num_thoughts=2, num_answers=2,
                             settings=SamplingSettings(**settings, generators=prompt_generators(8, 2, 2)))
    assert other_seed.thought_ids != part.thought_ids


def test_stop_candidates_are_the_tokens_that_can_finish_the_stop_text(tiny_policy):
    tok = tiny_policy.tokenizer
    candidates = tiny_policy.stop_candidates("</think>")
    assert tok.convert_tokens_to_ids("</think>") in candidates
    assert all(">" in tok.decode([i]) for i in candidates)
    others = [i for i in range(len(tok)) if i not in candidates]
    assert others and not any(">" in tok.decode([i]) for i in others)


def _tree_rows(policy, prompts, tree, num_thoughts, num_answers):
    """The training rows of a sampled tree: (prompt of each row, thought + answer ids, thought lengths)."""
    row_prompt, completions, thought_lengths = [], [], []
    for a, answer in enumerate(tree.answer_ids):
        t = a // num_answers
        row_prompt.append(t // num_thoughts)
        completions.append(tree.thought_ids[t] + answer)
        thought_lengths.append(len(tree.thought_ids[t]))
    return row_prompt, completions, thought_lengths


def test_shared_prefix_logprobs_and_gradients_equal_a_full_reencode(tiny_policy):
    """The training forward through the KV cache (each prompt and thought encoded once) gives the log-probs
    and the parameter gradients of re-encoding every row, for uneven prompts, thoughts and answers, rows in
    any order, a prompt whose rows are split, an empty thought and a one-token answer."""
    from vlm_grpo_ma.model.logprobs import shared_prefix_logprobs

    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(3)]
    tree = sample_tree(tiny_policy, prompts, num_thoughts=3, num_answers=2, settings=_settings(seed=4, answer_stop="e"))
    row_prompt, completions, thought_lengths = _tree_rows(tiny_policy, prompts, tree, 3, 2)
    assert len({len(t) for t in tree.thought_ids}) >= 3 and len({len(a) for a in tree.answer_ids}) >= 3
    order = torch.randperm(len(row_prompt), generator=torch.Generator().manual_seed(0))[:13].tolist()
    row_prompt = [row_prompt[i] for i in order] + [1, 2]
    completions = [completions[i] for i in order] + [[40, 41, 42], [43]]
    thought_lengths = [thought_lengths[i] for i in order] + [0, 1]
    params = [p for p in tiny_policy.model.parameters() if p.requires_grad]
    assert params

    def logprobs_and_grads(function, *extra):
        logprobs = function(tiny_policy, prompts, row_prompt, completions, *extra, temperature=0.7)
        weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(1))
        return logprobs.detach(), torch.autograd.grad((logprobs * weights).sum(), params)

    shared, shared_grads = logprobs_and_grads(shared_prefix_logprobs, thought_lengths)
    full, full_grads = logprobs_and_grads(sequence_logprobs)
    assert shared.shape == full.shape
    assert float((shared - full).abs().max()) <= 1e-4
    for got, want in zip(shared_grads, full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-8)
    # the check can fail: the same rows one token off (a pad slipped into each thought) differ
    slipped = [c[:t] + [tiny_policy.pad_token_id] + c[t:] for c, t in zip(completions, thought_lengths, strict=True)]
    with torch.no_grad():
        off = shared_prefix_logprobs(tiny_policy, prompts, row_prompt, slipped, thought_lengths, temperature=0.7)
    without_pad = torch.stack([torch.cat([off[r, :t], off[r, t + 1 :]]) for r, t in enumerate(thought_lengths)])
    assert float((without_pad - full).abs().max()) > 1e-2


def test_shared_prefix_logprobs_encode_each_prompt_and_thought_once(tiny_policy):
    """2 prompts x 2 thoughts x 3 answers: the decoder sees the 2 prompts, then 4 thoughts, then 12 answers
    (not 12 prompt + thought + answer rows), and the vision tower runs once on the 2 images."""
    from vlm_grpo_ma.model.logprobs import shared_prefix_logprobs

    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(2)]
    tree = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=3, settings=_settings(seed=2, answer_stop="e"))
    row_prompt, completions, thought_lengths = _tree_rows(tiny_policy, prompts, tree, 2, 3)
    decoder_batches, images = [], []
    decoder = tiny_policy.model.model.language_model
    hooks = [
        decoder.register_forward_pre_hook(lambda m, a, kw: decoder_batches.append(tuple(kw["inputs_embeds"].shape[:2])), with_kwargs=True),
        tiny_policy.model.model.visual.register_forward_pre_hook(lambda m, a, kw: images.append(int(a[1].shape[0] if len(a) > 1 else kw["grid_thw"].shape[0])), with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            shared_prefix_logprobs(tiny_policy, prompts, row_prompt, completions, thought_lengths, temperature=1.0)
    finally:
        for hook in hooks:
            hook.remove()
    assert [rows for rows, _ in decoder_batches] == [2, 4, 12]
    assert decoder_batches[0][1] == max(len(p.input_ids) for p in prompts)
    assert decoder_batches[1][1] == max(len(t) for t in tree.thought_ids)
    assert decoder_batches[2][1] == max(len(a) for a in tree.answer_ids) - 1  # an answer's last token predicts nothing
    assert images == [2]


def test_preallocated_sampling_cache_samples_what_the_growing_cache_samples(tiny_policy, monkeypatch):
    """sample_tree's KV cache writes into buffers allocated once; transformers' own grows by concatenation.
    Same seed, same tokens and log-probs; and the cache's keys are views of one buffer (no copy per token).
    Planted and seen to fail: the new tokens written one slot late (log-probs differ) and the buffer doubled
    on every update (the data pointer changes)."""
    from vlm_grpo_ma.engines import decode as decode_module
    from vlm_grpo_ma.model.cache import _sampling_cache

    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(2)]
    settings = dict(temperature=1.0, max_thought_tokens=10, max_answer_tokens=6, thought_stop="e")
    preallocated = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=2,
                               settings=SamplingSettings(**settings, generators=decode_module.prompt_generators(3, 0, 2)))
    growing_cache = _sampling_cache  # the same cache without a capacity: transformers' DynamicLayer
    monkeypatch.setattr(decode_module, "_sampling_cache", lambda policy, capacity: growing_cache(policy, None))
    growing = sample_tree(tiny_policy, prompts, num_thoughts=2, num_answers=2,
                          settings=SamplingSettings(**settings, generators=decode_module.prompt_generators(3, 0, 2)))
    assert preallocated.thought_ids == growing.thought_ids and preallocated.answer_ids == growing.answer_ids
    for a, b in ((preallocated.thought_logprobs, growing.thought_logprobs), (preallocated.answer_logprobs, growing.answer_logprobs)):
        assert max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)) <= 1e-6

    cache = growing_cache(tiny_policy, 8)
    layer = cache.layers[0]
    assert type(layer).__name__ == "PreallocatedLayer"
    keys = torch.randn(2, 1, 3, 4)
    layer.update(keys, keys.clone())
    first = layer.keys.data_ptr()
    layer.update(keys[:, :, :1], keys[:, :, :1].clone())
    assert layer.keys.data_ptr() == first and layer.keys.shape[-2] == 4
    assert torch.equal(layer.keys[:, :, 3], keys[:, :, 0])
    layer.update(keys.repeat(1, 1, 3, 1), keys.repeat(1, 1, 3, 1))  # past the capacity: it grows, still right
    assert layer.keys.shape[-2] == 13 and torch.equal(layer.keys[:, :, 4:7], keys)


def test_decoding_reads_the_kv_cache(tiny_policy):
    """One decode step after the prefill gives the log-probs of a full re-encode of prompt + token. A KV cache
    passed under a name the installed transformers does not take (5.19 takes past_key_values, 5.20 on cache)
    is swallowed by the model's **kwargs: the step then sees its one token without the prompt."""
    from vlm_grpo_ma.engines.decode import _step, prefill
    from vlm_grpo_ma.model.logprobs import _policy_logprobs
    from vlm_grpo_ma.model.prompts import _encode_images, _left_pad, _vision_inputs

    prompt = encode_prompt(tiny_policy, _samples(1)[0], "Think.")
    ids, mask = _left_pad([prompt.input_ids], tiny_policy.pad_token_id)
    vision, grid = _encode_images(tiny_policy, [prompt])
    with torch.no_grad():
        state = prefill(tiny_policy, ids, mask, grid, **_vision_inputs(vision))
        first, second = 300, 301  # two ordinary text tokens
        logits = _step(tiny_policy, state, torch.tensor([first]), torch.tensor([True]))
        cached = _policy_logprobs(logits, 1.0, tiny_policy.suppressed_token_ids)[0, second]
        full = sequence_logprobs(tiny_policy, [prompt], [0], [[first, second]], temperature=1.0)[0, 1]
    assert abs(float(cached) - float(full)) < 1e-4


def test_the_log_prob_head_does_not_copy_its_weight_per_row(tiny_policy):
    """With a frozen output head (LoRA, a frozen tied embedding), the shared-prefix forward's thought
    log-probs must not make matmul copy the [H, V] weight once per row: at a real vocabulary that copy is
    ~1 GB. Planted and seen to fail: the head fed the sliced hidden states as they come (no .contiguous())."""
    from torch.profiler import ProfilerActivity, profile

    from vlm_grpo_ma.model.logprobs import shared_prefix_logprobs

    prompts = [encode_prompt(tiny_policy, s, "Think.") for s in _samples(2)]
    tree = sample_tree(tiny_policy, prompts, num_thoughts=4, num_answers=2, settings=_settings(seed=3, answer_stop="e"))
    row_prompt, completions, thought_lengths = _tree_rows(tiny_policy, prompts, tree, 4, 2)
    head = tiny_policy.model.lm_head.weight
    frozen = [p for p in tiny_policy.model.parameters() if p.data_ptr() == head.data_ptr()]
    for p in frozen:
        p.requires_grad_(False)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
            logprobs = shared_prefix_logprobs(tiny_policy, prompts, row_prompt, completions, thought_lengths, temperature=1.0)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    assert logprobs.requires_grad
    vocab, hidden = head.shape
    # the copy: an op that allocates while taking a batch of [H, V] weights (the bmm path's .contiguous())
    copies = [(e.name, e.input_shapes) for e in prof.events() if e.cpu_memory_usage > 0 and any(len(shape) == 3 and shape[1:] == [hidden, vocab] for shape in e.input_shapes)]
    assert not copies, f"the head's weight was copied per row: {copies[:3]}"
