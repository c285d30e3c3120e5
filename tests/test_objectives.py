"""The objectives, exact: flat GRPO through the tree equals re-encoding the K*M sequences one by one (DeepSeekMath's
and DAPO's normalisers, with importance ratios away from 1 and clipping); the policy losses peers ship (GSPO,
CISPO) against hand-computed tables; DAPO's overlong shaping; dynamic sampling end to end."""

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_config
from PIL import Image

from vlm_grpo_ma.algorithm.advantages import compute_advantages, informative_prompts, overlong_penalty
from vlm_grpo_ma.algorithm.loss import POLICY_LOSSES, aggregation_weights, policy_loss, segment_ids
from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
from vlm_grpo_ma.engines.rollout import generate_rollout
from vlm_grpo_ma.model.loading import load_policy
from vlm_grpo_ma.model.logprobs import CompletionScorer, sequence_logprobs
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.run import loop as train_module
from vlm_grpo_ma.run.batch import build_train_batch
from vlm_grpo_ma.task_api.registry import Sample

LENGTH_TASK = str(Path(__file__).parent / "fixtures" / "answer_length_task.py")  # rewards the untrained model varies on
CLIP_LOW, CLIP_HIGH, EPS = 0.2, 0.28, 1e-6
B, K, M = 2, 2, 3
# Rewards [B, K, M] with ties and spread, so advantages differ within a thought (flat GRPO pushes a thought by
# M different advantages) and across prompts.
REWARDS = torch.tensor(
    [[[1.0, 0.0, 0.5], [0.2, 0.9, 0.0]], [[0.3, 0.3, 1.0], [0.0, 1.0, 0.4]]], dtype=torch.float64
)


@pytest.fixture(scope="module")
def double_policy(untrained_tiny_dir):
    """The untrained tiny model in float64, so that the two paths differ only by rounding far below 1e-6."""
    policy = load_policy(str(untrained_tiny_dir), attn_implementation="sdpa")
    policy.model.double().eval()
    return policy


@pytest.fixture(scope="module")
def sampled(double_policy):
    """A real K x M tree from the model: 2 prompts (different images and question lengths), 2 thoughts, 3 answers."""
    colours, sizes = [(220, 30, 30), (30, 200, 40)], [(168, 112), (112, 140)]
    samples = [
        Sample("grounding", str(i), "Locate: the red circle" + " please" * (2 * i), (Image.new("RGB", sizes[i], colours[i]),), [0, 0, 1, 1])
        for i in range(B)
    ]  # fmt: skip
    prompts = [encode_prompt(double_policy, s, "Think.") for s in samples]
    settings = SamplingSettings(max_thought_tokens=6, max_answer_tokens=5, generators=prompt_generators(3, 0, B))
    with torch.no_grad():
        rollout = generate_rollout(double_policy, samples, prompts, num_thoughts=K, num_answers=M, settings=settings)
    return prompts, rollout


def _old_logprobs_offset(rows: int, width: int) -> torch.Tensor:
    """A fixed offset old = new - offset: importance ratios between e^-0.45 and e^0.45, so the clip acts on
    some tokens in both directions. Position (row, j) is the same token in both paths."""
    index = torch.arange(rows * width, dtype=torch.float64).reshape(rows, width)
    return 0.45 * torch.sin(1.7 * index + 0.3)


def _grads(policy) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().clone() for name, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad(set_to_none=True)
    return grads


def _tree_gradient(policy, prompts, rollout, aggregation: str) -> dict[str, torch.Tensor]:
    """The trainer's pieces: estimator -> batch -> aggregation weights -> shared-prefix scorer -> policy loss."""
    thought_adv, answer_adv = compute_advantages("grpo", REWARDS, answer_baseline="prompt", scale_by_std=True, eps=EPS, unbiased=False)
    batch = build_train_batch(rollout, thought_adv, answer_adv, truncated_thoughts="close")
    weights = aggregation_weights(
        aggregation, batch.token_mask, batch.is_thought, flat=batch.flat, num_tokens=batch.num_trained_tokens(),
        num_thoughts=B * K, num_answers=B * K * M, max_thought_tokens=6, max_answer_tokens=5,
    )  # fmt: skip
    scorer = CompletionScorer(policy, share_prefixes=True)
    logprobs = scorer(prompts, batch.row_prompt, batch.completion_ids, batch.thought_lengths(), temperature=1.0).double()
    old = logprobs.detach() - _old_logprobs_offset(*logprobs.shape)
    loss, _ = policy_loss(
        logprobs, old, batch.advantages.double(), weights, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, total_weight=1.0,
        segments=segment_ids(batch.token_mask, batch.is_thought, flat=batch.flat),
    )  # fmt: skip
    loss.backward()
    return _grads(policy)


def _flat_reference_gradient(policy, prompts, rollout, aggregation: str) -> dict[str, torch.Tensor]:
    """GRPO as published, written out here: each of the K*M sequences (thought + answer) re-encoded on its own,
    every token of sequence i pushed by A_i = (r_i - mean) / (std + eps) over its prompt's G = K*M rewards,
    PPO's clipped surrogate per token, and DeepSeekMath's ``1/B sum_b 1/G sum_i 1/|o_i| sum_t`` or DAPO's
    ``1 / sum_i |o_i| sum_i sum_t``. Forced tokens (a truncated thought's closing tag) are not the policy's."""
    tree = rollout.tree
    width = max(len(tree.thought_ids[a // M]) + len(tree.answer_ids[a]) for a in range(B * K * M))
    offsets = _old_logprobs_offset(B * K * M, width)
    sequences = []  # (a, b, advantage, trained mask)
    for b in range(B):
        group = [float(r) for r in REWARDS[b].flatten()]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        for k in range(K):
            t = b * K + k
            for m in range(M):
                a = t * M + m
                trained = [not f for f in tree.thought_forced[t]] + [not tree.thought_ended_turn[t]] * len(tree.answer_ids[a])
                sequences.append((a, b, (float(REWARDS[b, k, m]) - mean) / (std + EPS), trained))
    total_tokens = sum(sum(trained) for *_, trained in sequences)
    loss = 0.0
    for a, b, advantage, trained in sequences:
        completion = tree.thought_ids[a // M] + tree.answer_ids[a]
        logprobs = sequence_logprobs(policy, [prompts[b]], [0], [completion], temperature=1.0)[0].double()
        length = sum(trained)
        for j, counted in enumerate(trained):
            if not counted:
                continue
            ratio = torch.exp(offsets[a, j] + logprobs[j] - logprobs[j].detach())  # exp(new - old)
            surrogate = -torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * advantage)
            weight = 1.0 / (B * K * M * length) if aggregation == "sequence" else 1.0 / total_tokens
            loss = loss + weight * surrogate
    loss.backward()
    return _grads(policy)


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_flat_grpo_through_the_tree_is_reencoding_the_k_times_m_sequences(double_policy, sampled, aggregation):
    prompts, rollout = sampled
    assert len(set(map(tuple, rollout.tree.thought_ids))) > 1 and any(len(ids) > 1 for ids in rollout.tree.thought_ids)
    tree = _tree_gradient(double_policy, prompts, rollout, aggregation)
    reference = _flat_reference_gradient(double_policy, prompts, rollout, aggregation)
    assert tree.keys() == reference.keys() and len(tree) > 10
    scale = max(float(g.abs().max()) for g in reference.values())
    assert scale > 1e-3  # a gradient to compare, not zeros
    worst = max(float((tree[name] - reference[name]).abs().max()) for name in reference)
    assert worst < 1e-6 * max(1.0, scale), (aggregation, worst, scale)


# --- policy losses against hand-computed tables ------------------------------------------------------------
# One row, three trained tokens: a thought of two tokens (log-ratios 0.1, 0.3) and an answer of one (-0.5).
NEW = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
OLD = NEW - torch.tensor([[0.1, 0.3, -0.5]], dtype=torch.float64)
ADV = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
MASK = torch.ones(1, 3, dtype=torch.float64)
IS_THOUGHT = torch.tensor([[True, True, False]])


def _loss_and_grad(name: str, *, clip_low=CLIP_LOW, flat=False):
    new = NEW.clone().requires_grad_(True)
    loss, stats = policy_loss(
        new, OLD, ADV, MASK, clip_low=clip_low, clip_high=CLIP_HIGH, total_weight=1.0, surrogate=name,
        segments=segment_ids(MASK, IS_THOUGHT, flat=flat),
    )  # fmt: skip
    loss.backward()
    return float(loss.detach()), new.grad[0].tolist(), float(stats["clip_fraction_sum"])


def test_gspo_uses_each_sequences_length_normalised_ratio_on_the_tree():
    # thought: s = exp(mean(0.1, 0.3)) = e^0.2 = 1.22140, inside [0.8, 1.28]: both tokens -A * s, gradient -s each.
    # answer: s = e^-0.5 = 0.60653 < 0.8 with A = -1: min(-0.60653, -0.8) = -0.8 is the clipped branch: loss 0.8, no gradient.
    loss, grad, clipped = _loss_and_grad("gspo")
    s = math.exp(0.2)
    assert loss == pytest.approx(-2 * s + 0.8, abs=1e-12)
    assert grad == pytest.approx([-s, -s, 0.0], abs=1e-12)
    assert clipped == 1.0


def test_gspo_flat_takes_the_whole_row_as_one_sequence():
    # one sequence: s = exp(mean(0.1, 0.3, -0.5)) = e^(-0.1/3) = 0.96722, unclipped; loss -s*(1 + 1 - 1), gradient -A*s
    loss, grad, clipped = _loss_and_grad("gspo", flat=True)
    s = math.exp(-0.1 / 3)
    assert loss == pytest.approx(-s, abs=1e-12)
    assert grad == pytest.approx([-s, -s, s], abs=1e-12)
    assert clipped == 0.0


def test_cispo_clips_the_weight_but_keeps_every_tokens_gradient():
    # weights: e^0.1 = 1.10517 and e^0.3 = 1.34986 -> clipped to 1.28; e^-0.5 = 0.60653 -> clipped up to 0.8.
    # loss = -sum(w * A * logp); gradient -w * A.
    loss, grad, clipped = _loss_and_grad("cispo")
    w = [math.exp(0.1), 1.28, 0.8]
    assert grad == pytest.approx([-w[0], -w[1], w[2]], abs=1e-12)
    assert loss == pytest.approx(-(w[0] * -1.0 + w[1] * -2.0) + w[2] * -0.5, abs=1e-12)
    assert clipped == 2.0
    # MiniMax-M1 leaves the lower side open (clip_low = 1): the answer's weight stays 0.60653
    _, open_grad, _ = _loss_and_grad("cispo", clip_low=1.0)
    assert open_grad[2] == pytest.approx(math.exp(-0.5), abs=1e-12)


def test_ppo_zeroes_the_gradient_of_clipped_tokens_where_cispo_does_not():
    # ppo: e^0.3 = 1.34986 > 1.28 with A = 1: clipped, no gradient; e^-0.5 < 0.8 with A = -1: clipped, no gradient.
    _, grad, clipped = _loss_and_grad("ppo")
    assert grad == pytest.approx([-math.exp(0.1), 0.0, 0.0], abs=1e-12)
    assert clipped == 2.0


def test_an_unknown_policy_loss_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'; known: ppo, gspo, cispo"):
        _loss_and_grad("grpo")


def test_config_choices_are_the_registered_policy_losses():
    from vlm_grpo_ma.run.config import CHOICES, ConfigError
    from vlm_grpo_ma.run.config_files import load_config

    assert CHOICES["algorithm.policy_loss"] == tuple(POLICY_LOSSES)
    with pytest.raises(ConfigError, match="algorithm.policy_loss='sapo' is not valid; choose one of: ppo, gspo, cispo"):
        load_config(None, ["algorithm.policy_loss=sapo"])


def test_segment_ids_split_the_tree_rows_into_thought_and_answer_and_keep_flat_rows_whole():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.float64)
    is_thought = torch.tensor([[True, True, False, False], [True, True, False, False]])
    assert segment_ids(mask, is_thought, flat=False).tolist() == [[0, 0, 1, -1], [-1, -1, 3, 3]]
    assert segment_ids(mask, is_thought, flat=True).tolist() == [[0, 0, 0, -1], [-1, -1, 2, 2]]


# --- DAPO's overlong shaping and dynamic sampling's signal test -------------------------------------------


def test_overlong_penalty_ramps_over_the_buffer_before_the_limit():
    lengths = torch.tensor([3, 6, 7, 8, 9, 10])
    # max 10, buffer 4: free up to 6, then -1/4 per token, -1 at the limit (times the penalty)
    assert overlong_penalty(lengths, max_tokens=10, buffer_tokens=4).tolist() == [0, 0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, max_tokens=10, buffer_tokens=4, penalty=0.5).tolist() == [0, 0, -0.125, -0.25, -0.375, -0.5]
    assert overlong_penalty(lengths, max_tokens=10, buffer_tokens=0).tolist() == [0.0] * 6
    with pytest.raises(ValueError, match="buffer_tokens must be in \\[0, max_tokens=10\\], got 11"):
        overlong_penalty(lengths, max_tokens=10, buffer_tokens=11)


def test_overlong_buffer_longer_than_the_limit_is_refused_at_start():
    from vlm_grpo_ma.run.config import ConfigError
    from vlm_grpo_ma.run.config_files import load_config

    with pytest.raises(ConfigError, match="algorithm.overlong_buffer_answer_tokens=30 must be <= rollout.max_answer_tokens=24"):
        load_config(None, ["algorithm.overlong_buffer_answer_tokens=30"])


def test_informative_prompts_are_those_whose_rewards_differ():
    rewards = torch.tensor([[[1.0, 1.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.5]], [[0.2, 0.2], [0.2, 0.2]]])
    assert informative_prompts(rewards).tolist() == [False, True, False]


def test_the_step_trains_the_first_informative_groups_in_draw_order_then_fills():
    from vlm_grpo_ma.run.dynamic_sampling import choose_groups

    # two draws of 4 prompts: 3 informative in the first, 2 in the second; the step needs 4
    assert choose_groups([True, True, False, True, True, False, True, False], 4) == [0, 1, 3, 4]
    # the draws ran out with 2 informative groups: the first 2 uninformative ones fill the step
    assert choose_groups([False, True, False, False, True, False, False, False], 4) == [1, 4, 0, 2]
    assert choose_groups([False] * 4, 4) == [0, 1, 2, 3]


def test_gathered_groups_keep_each_prompts_tree_and_scores_in_the_order_given():
    from vlm_grpo_ma.engines.decode import TreeSample
    from vlm_grpo_ma.engines.rollout import Rollout, gather_groups
    from vlm_grpo_ma.run.rewards import ScoredRollout, gather_scored_groups

    def draw(offset):  # B = 2 prompts, K = 2, M = 2; token ids say (draw, prompt, thought, answer)
        tree = TreeSample(
            thought_ids=[[offset + 10 * t] for t in range(4)], thought_logprobs=[[-1.0]] * 4, thought_forced=[[False]] * 4,
            thought_truncated=[False, True, False, False], thought_ended_turn=[False] * 4,
            answer_ids=[[offset + a] for a in range(8)], answer_logprobs=[[-2.0]] * 8, answer_truncated=[False] * 8,
            vision_images_encoded=2,
        )  # fmt: skip
        rollout = Rollout([f"s{offset}-0", f"s{offset}-1"], [f"p{offset}-0", f"p{offset}-1"], 2, 2, tree, [f"c{offset + a}" for a in range(8)])
        scored = ScoredRollout(torch.zeros(2, 2, 2), {}, [{"reward": float(offset + a)} for a in range(8)])
        return rollout, scored

    (first, first_scores), (second, second_scores) = draw(100), draw(200)
    rollout = gather_groups([(second, 1), (first, 0)])
    assert rollout.samples == ["s200-1", "s100-0"] and rollout.prompts == ["p200-1", "p100-0"]
    assert rollout.tree.thought_ids == [[220], [230], [100], [110]]
    assert rollout.tree.thought_truncated == [False, False, False, True]
    assert rollout.tree.answer_ids == [[204], [205], [206], [207], [100], [101], [102], [103]]
    assert rollout.completions[0] == "c204" and rollout.tree.vision_images_encoded == 4
    scored = gather_scored_groups([(second_scores, 1), (first_scores, 0)], Counter(drawn=2))
    assert scored.rewards.tolist() == [[[204, 205], [206, 207]], [[100, 101], [102, 103]]]
    assert scored.counters == Counter(drawn=2)


def test_the_answer_length_penalty_skips_answers_void_by_rule():
    """An answer after a thought that ended the turn is text past the end; its length penalty valued the thought
    by it. Planted: every answer's length counted; the void answers got -1 and the thought's group its mean."""
    from vlm_grpo_ma.engines.decode import TreeSample
    from vlm_grpo_ma.engines.rollout import Rollout
    from vlm_grpo_ma.run.rewards import ScoredRollout, add_overlong_penalty

    # B = 1, K = 2, M = 2: thought 0 ended the turn; every answer is 10 tokens, at the limit
    tree = TreeSample(
        thought_ids=[[1], [2]], thought_logprobs=[[-1.0]] * 2, thought_forced=[[False]] * 2, thought_truncated=[False] * 2,
        thought_ended_turn=[True, False], answer_ids=[[5] * 10] * 4, answer_logprobs=[[-1.0] * 10] * 4,
        answer_truncated=[True] * 4,
    )  # fmt: skip
    rollout = Rollout(["s"], ["p"], 2, 2, tree, ["c"] * 4)
    scored = ScoredRollout(torch.zeros(1, 2, 2), {}, [{"reward": 0.0}] * 4)
    shaped = add_overlong_penalty(scored, rollout, max_thought_tokens=8, max_answer_tokens=10, thought_buffer=4,
                                  answer_buffer=4, penalty=1.0, truncated_thoughts="close")  # fmt: skip
    assert shaped.rewards.tolist() == [[[0.0, 0.0], [-1.0, -1.0]]]
    assert [p["overlong"] for p in shaped.per_answer_parts] == [0.0, 0.0, -1.0, -1.0]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dynamic_sampling_draws_more_prompts_counts_them_and_resumes_exactly(untrained_tiny_dir, tmp_path):
    """The untrained model rarely writes the format, so most groups score all 0: the step draws again and
    fills with uninformative groups when the draws run out. Stopped after step 1 and resumed = straight."""
    extra = ("algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_draws=1", "train.checkpoint_every=1",
             "data.reward_weights={format: 1.0, iou: 1.0}")  # fmt: skip
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train_module.train(tiny_run_config(untrained_tiny_dir, straight, *extra, steps=2))
    train_module.train(tiny_run_config(untrained_tiny_dir, stopped, *extra, steps=1))
    train_module.train(tiny_run_config(untrained_tiny_dir, stopped, *extra, steps=2), resume=True)
    a, b = _metrics(straight), _metrics(stopped)
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]
    assert [r["signal/resampled_prompts"] for r in a] == [r["signal/resampled_prompts"] for r in b]
    drawn = [r["signal/resampled_prompts"] for r in a]
    assert all(d in (0, 2) for d in drawn) and sum(drawn) > 0  # whole extra draws of 2 prompts
    for r in a:  # a step short of informative groups after its draws trains the uninformative ones it has
        informative = 2 - r["signal/uninformative_groups_trained"]
        assert r["signal/uninformative_groups_trained"] == 0 or r["signal/resampled_prompts"] == 2, r
        assert r["signal/zero_prompt_groups"] == pytest.approx(1 - informative / 2)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["counters"]["resampled_prompts"] == sum(drawn)
    # generated tokens count every draw the rollout time paid for (planted: the last draw's only; the redrawn
    # steps then fell short of the trained tree's tokens or equalled them)
    for r in a:
        trained = 2 * 2 * r["rollout/thought_tokens"] + 2 * 2 * 2 * r["rollout/answer_tokens"]  # B = K = M = 2
        assert (r["rollout/generated_tokens"] > trained) if r["signal/resampled_prompts"] else (r["rollout/generated_tokens"] == pytest.approx(trained)), r


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.policy_loss=cispo",),
        ("algorithm.policy_loss=gspo", "algorithm.num_iterations=2", "algorithm.clip_low=0.0003", "algorithm.clip_high=0.0004"),
        ("algorithm.loss_aggregation=dr_grpo", "algorithm.scale_by_std=false", "algorithm.overlong_buffer_answer_tokens=3"),
    ],
)
def test_each_objective_trains_from_the_config(untrained_tiny_dir, tmp_path, overrides):
    """Each objective trains from the config. The loop passes the configured policy loss to the update: CISPO's
    logged loss is its REINFORCE form (``train/loss == train/pg_loss`` at ratio 1, where PPO's is ``-sum(w * A)``;
    planted: the update always using ppo, seen to fail). GSPO trains a reused rollout, clipping at its paper's
    range; Dr.GRPO with overlong shaping logs the penalty part."""
    task = ("data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]")
    train_module.train(tiny_run_config(untrained_tiny_dir, tmp_path, *task, *overrides, steps=2))
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    if "algorithm.policy_loss=cispo" in overrides:
        assert [r["train/loss"] for r in records] == pytest.approx([r["train/pg_loss"] for r in records], rel=1e-4)
    if "algorithm.policy_loss=gspo" in overrides:
        assert any(r["train/clip_fraction"] > 0 for r in records)  # sequence ratios leave [1 - 3e-4, 1 + 4e-4]
    if "algorithm.overlong_buffer_answer_tokens=3" in overrides:
        assert all(r["reward/overlong"] <= 0 for r in records) and any(r["reward/overlong"] < 0 for r in records)


def test_the_configured_aggregation_reaches_the_update(untrained_tiny_dir, tmp_path):
    """The same first step (same samples) under token and dr_grpo weighs thoughts differently: token by their
    share of the trained tokens, dr_grpo by half the step whatever their lengths (the thoughts' half over their
    longest length). Planted and seen to fail: the update ignoring algorithm.loss_aggregation."""
    task = ("data.task=answer_length", f"data.task_modules=[{LENGTH_TASK}]")
    shares = {}
    for name in ("token", "dr_grpo"):
        train_module.train(tiny_run_config(untrained_tiny_dir, tmp_path / name, *task, f"algorithm.loss_aggregation={name}", steps=1))
        (record,) = _metrics(tmp_path / name)
        shares[name] = record["train/thought_weight_share"]
        tokens = (record["rollout/thought_tokens"], record["rollout/answer_tokens"])
    assert shares["token"] != pytest.approx(shares["dr_grpo"], abs=1e-3), (shares, tokens)
