"""Tool turns inside the thought (issue 46), through the HF tree sampler and the training forward.

The thoughts' text is scripted (``scripted_thoughts``: an untrained model never writes a call), everything else
is the real sampler: the turns fed between the model's pieces, their crops through the vision tower, the
positions, the sampling log-probs; and the real trainer's forwards."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from scripted_thoughts import scripted

from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
from vlm_grpo_ma.engines.rollout import generate_rollout
from vlm_grpo_ma.model.logprobs import sequence_logprobs, shared_prefix_logprobs
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.task_api.registry import Sample, Task, register_task
from vlm_grpo_ma.task_api.tools import ZOOM_TOOL

ZOOM = '<think>a<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [20, 10, 60, 50]}}</tool_call>'
UNKNOWN = '<think>b<tool_call>{"name": "nope"}</tool_call>'
K, M = 3, 2


def _register_and_make_samples(folder):
    """Tasks "zt" (the zoom tool) and "plain" (no tools) in the registry, and three samples of a 300 x 200 scene."""
    register_task(Task(name="zt", load=lambda *a: [], reward=lambda c, s: {"reward": 0.0}, instruction="", tools=(ZOOM_TOOL,)))
    register_task(Task(name="plain", load=lambda *a: [], reward=lambda c, s: {"reward": 0.0}, instruction=""))
    image = Image.new("RGB", (300, 200), (200, 30, 30))
    image.paste((10, 200, 10), (100, 50, 140, 90))
    image.save(folder / "scene.png")
    return [Sample("zt", "z0", "what colour?", (str(folder / "scene.png"),), "green"),
            Sample("zt", "z1", "what colour?", (str(folder / "scene.png"),), "green"),
            Sample("plain", "p", "what colour?", (str(folder / "scene.png"),), "green")]  # fmt: skip


@pytest.fixture
def zoom_samples(fresh_registry, tmp_path):
    return _register_and_make_samples(tmp_path)


# One tree for most tests: thought 0 looks once, 1 fails then looks, 2 calls a thousand times (over-turn at its
# third call), 4 looks and goes on sampling, 6 belongs to a task without tools and writes a call as text.
SCRIPTS = {0: [ZOOM, "seen</think>"], 1: [UNKNOWN, ZOOM, "x</think>"], 2: [ZOOM] + [ZOOM.replace("<think>a", "")] * 1000,
           4: [ZOOM], 6: [ZOOM, "more</think>"]}  # fmt: skip


@pytest.fixture(scope="module")
def tree_with_turns(tiny_policy, tmp_path_factory):
    """Sampled once for the module, its two tasks registered only while it samples."""
    from vlm_grpo_ma.task_api import registry

    registry.load_builtin_tasks()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_TASKS", dict(registry._TASKS))
        patch.setattr(registry, "_SOURCES", dict(registry._SOURCES))
        samples = _register_and_make_samples(tmp_path_factory.mktemp("scene"))
        return _rollout(patch, tiny_policy, samples, SCRIPTS, max_thought_tokens=330)


def _rollout(monkeypatch, policy, samples, scripts, *, max_turns=2, max_thought_tokens=250):
    prompts = [encode_prompt(policy, s, "") for s in samples]
    with monkeypatch.context() as patch:
        scripted(patch, policy, scripts, num_thought_rows=len(samples) * K)
        settings = SamplingSettings(max_thought_tokens=max_thought_tokens, max_answer_tokens=6, max_turns=max_turns,
                                    generators=prompt_generators(1, 0, len(samples)))  # fmt: skip
        rollout = generate_rollout(policy, samples, prompts, num_thoughts=K, num_answers=M, settings=settings)
    return prompts, rollout


def _rows(rollout):
    tree = rollout.tree
    rows = range(len(tree.answer_ids))
    completions = [tree.thought_ids[a // M] + tree.answer_ids[a] for a in rows]
    return dict(
        row_prompt=[a // (K * M) for a in rows],
        completions=completions,
        thought_lengths=[len(tree.thought_ids[a // M]) for a in rows],
        turns=[tree.thought_turns[a // M] for a in rows],
        engine=[torch.tensor(tree.thought_logprobs[a // M] + tree.answer_logprobs[a]) for a in rows],
        sampled=[~torch.tensor(tree.thought_forced[a // M] + [False] * len(tree.answer_ids[a])) for a in rows],
    )


def _assert_sampler_equals_trainer(policy, prompts, rollout):
    """The sampler's log-probs on the model's own tokens equal the shared-prefix forward's and a full re-encode's
    (float32, 1e-4); returns (shared, full)."""
    rows = _rows(rollout)
    with torch.no_grad():
        shared = shared_prefix_logprobs(policy, prompts, rows["row_prompt"], rows["completions"], rows["thought_lengths"],
                                        temperature=1.0, thought_turns=rows["turns"])  # fmt: skip
        full = sequence_logprobs(policy, prompts, rows["row_prompt"], rows["completions"], temperature=1.0, thought_turns=rows["turns"])
    for a, completion in enumerate(rows["completions"]):
        n, own = len(completion), rows["sampled"][a]
        assert float((shared[a, :n] - rows["engine"][a]).abs()[own].max()) < 1e-4
        assert float((full[a, :n] - rows["engine"][a]).abs()[own].max()) < 1e-4
    return shared, full


def test_the_trainer_scores_what_the_sampler_sampled_around_tool_turns(tiny_policy, tree_with_turns):
    """Rows that look (a crop), fail (an error turn), look twice, or never call: the sampler's log-probs on the
    model's own tokens equal the shared-prefix forward's and a full re-encode's in float32, and the two
    forwards agree everywhere (turn tokens 0 in both). Planted: the block's positions as plain text (images
    ignored): this failed."""
    prompts, rollout = tree_with_turns
    tree = rollout.tree
    assert [len(t) for t in tree.thought_turns] == [1, 2, 2, 0, 1, 0, 0, 0, 0]
    assert [turn.error for turn in tree.thought_turns[1]] == [True, False]
    assert tree.thought_turns[0][0].num_images == 1 and rollout.completions[0].tool_images == 1
    assert rollout.completions[1 * M].invalid_tool_calls == 1 and rollout.completions[1 * M].tool_calls == 2
    assert "nope" in rollout.completions[1 * M].thought  # the error turn's text, as the model read it
    shared, full = _assert_sampler_equals_trainer(tiny_policy, prompts, rollout)
    assert torch.isfinite(shared).all() and float((shared - full).abs().max()) < 1e-4


def test_the_gradient_through_tool_turns_equals_a_re_encode(tiny_policy, tree_with_turns):
    """The shared-prefix forward's parameter gradient equals the re-encode's, crops included (the vision tower
    trained here): backward runs through the turns' cache and their images. Planted: the block's positions as
    plain text (images ignored) in the shared forward: the gradients differed."""
    prompts, rollout = tree_with_turns
    rows = _rows(rollout)
    weights = [torch.linspace(0.5, 1.5, len(c)) * own for c, own in zip(rows["completions"], rows["sampled"], strict=True)]
    grads = []
    tiny_policy.model.requires_grad_(True)
    try:
        for share in (True, False):
            tiny_policy.model.zero_grad(set_to_none=True)
            if share:
                lp = shared_prefix_logprobs(tiny_policy, prompts, rows["row_prompt"], rows["completions"], rows["thought_lengths"],
                                            temperature=1.0, thought_turns=rows["turns"])  # fmt: skip
            else:
                lp = sequence_logprobs(tiny_policy, prompts, rows["row_prompt"], rows["completions"], temperature=1.0, thought_turns=rows["turns"])
            loss = sum((lp[a, : len(w)] * w).sum() for a, w in enumerate(weights))
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in tiny_policy.model.named_parameters() if p.grad is not None})
    finally:
        tiny_policy.model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    assert any("visual" in name for name in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=2e-5, rtol=1e-3, msg=name)


def test_a_call_past_max_turns_closes_the_thought_out_of_the_loss(tree_with_turns):
    """With max_turns=2 the third call closes the thought with a forced "</think>" (over-turn): a script of a
    thousand calls gets no further. Its tokens and its answers get weight 0; a served turn's tokens are context
    (weight 0) in a thought that is trained; a task without tools writes "</tool_call>" as text and goes on.
    Planted: the bound not checked (the thought then ran to its token limit with 3 turns); the over-turn mask
    dropped in batch.py."""
    from vlm_grpo_ma.run.batch import build_train_batch

    _, rollout = tree_with_turns
    tree = rollout.tree
    assert [t for t, over in enumerate(tree.thought_over_turns) if over] == [2]
    assert len(tree.thought_turns[2]) == 2 and not tree.thought_truncated[2]
    assert rollout.completions[2 * M].thought.endswith("</tool_call></think>") and rollout.completions[2 * M].tool_calls == 3
    assert not tree.thought_turns[6] and rollout.completions[6 * M].thought.endswith("more</think>")
    batch = build_train_batch(rollout, torch.ones(3, K), torch.ones(3, K, M), truncated_thoughts="close")
    for m in range(M):
        assert float(batch.token_mask[2 * M + m].sum()) == 0.0  # neither the thought nor its answers
    assert batch.thought_turns[0] == tree.thought_turns[0]
    for t in (0, 1, 3):  # every token the policy sampled is trained, no turn token is
        own = [not forced for forced in tree.thought_forced[t]]
        assert batch.token_mask[t * M][: len(own)].tolist() == [float(x) for x in own]
        for turn in tree.thought_turns[t]:
            assert float(batch.token_mask[t * M, turn.start : turn.start + len(turn.ids)].sum()) == 0.0


def test_a_result_over_the_thought_budget_truncates(monkeypatch, tiny_policy, zoom_samples):
    """A turn that does not fit in what is left of max_thought_tokens truncates the thought instead of
    overflowing it. Planted: the budget check dropped: thoughts past the budget."""
    call_tokens = len(tiny_policy.tokenizer.encode(ZOOM, add_special_tokens=False))
    _, rollout = _rollout(monkeypatch, tiny_policy, zoom_samples[:1], {0: [ZOOM, "q</think>"]}, max_thought_tokens=call_tokens + 12)
    assert rollout.tree.thought_truncated[0] and not rollout.tree.thought_turns[0]
    assert all(len(ids) <= call_tokens + 12 for ids in rollout.tree.thought_ids)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_5"])
def test_tool_turns_on_every_family(monkeypatch, zoom_samples, tmp_path, family):
    """The same check on the other families' tiny models: Qwen2-VL's frame (0-1000), Qwen3-VL's deepstack
    features for the crop, Qwen3.5's linear-attention state carried through a turn fed as a ragged block. The
    sampler's log-probs on the model's own tokens equal the shared-prefix forward's and a re-encode's. Planted:
    the block's positions as plain text: all three failed."""
    from tiny_families import save_tiny

    from vlm_grpo_ma.model.loading import load_policy

    policy = load_policy(str(save_tiny(family, tmp_path / family)), attn_implementation="sdpa")
    policy.model.eval()
    zoom_10 = ZOOM.replace("[20, 10, 60, 50]", "[100, 100, 600, 700]") if family != "qwen2_5_vl" else ZOOM
    scripts = {0: [zoom_10, "seen</think>"], 1: [UNKNOWN, "x</think>"]}
    call_tokens = len(policy.tokenizer.encode(zoom_10 + UNKNOWN, add_special_tokens=False))
    prompts, rollout = _rollout(monkeypatch, policy, zoom_samples[:1], scripts, max_thought_tokens=call_tokens + 90)
    tree = rollout.tree
    assert tree.thought_turns[0][0].num_images == 1 and tree.thought_turns[1][0].error
    _assert_sampler_equals_trainer(policy, prompts, rollout)
