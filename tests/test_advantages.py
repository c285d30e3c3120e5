"""Tests for vlm_grpo_ma.algorithm.advantages: hand-computed values, a slow loop reference, invariances, M = 1 == GRPO.

Tolerances: hand values are pinned at 1e-12 in float64 (the code's rounding error is ~1e-16). Comparisons
against the loop reference and the invariance checks use 1e-12 in float64: reductions in a different order
differ by a few ulps (~1e-15 on advantages of magnitude <= sqrt(K*M)), far below 1e-12, while any real bug
(wrong std estimator, wrong group, eps misplaced) moves values by >= 1e-7.
"""

from __future__ import annotations

import itertools
import math
import statistics
import warnings

import pytest
import torch

from vlm_grpo_ma.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    flat_grpo_advantages,
    group_normalize,
    grpo_advantages,
    grpo_ma_advantages,
)

F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)
SQRT2, SQRT3 = math.sqrt(2.0), math.sqrt(3.0)


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, **TOL)


# --- slow pure-Python reference --------------------------------------------------------------------------


def ref_normalize(values: list[float], *, scale_by_std: bool, eps: float, unbiased: bool) -> list[float]:
    if len(values) <= 1 or all(v == values[0] for v in values):
        return [0.0] * len(values)
    mean = statistics.fmean(values)
    if not scale_by_std:
        return [v - mean for v in values]
    std = statistics.stdev(values) if unbiased else statistics.pstdev(values)
    return [(v - mean) / (std + eps) for v in values]


def ref_grpo_ma(rewards: list, *, answer_baseline: str, scale_by_std: bool, eps: float, unbiased: bool):
    """rewards: nested lists [B][K][M] -> (thought_adv [B][K], answer_adv [B][K][M]), by loops."""
    kw = dict(scale_by_std=scale_by_std, eps=eps, unbiased=unbiased)
    thought_adv, answer_adv = [], []
    for prompt in rewards:
        num_thoughts, num_answers = len(prompt), len(prompt[0])
        thought_means = [math.fsum(thought) / num_answers for thought in prompt]
        thought_adv.append(ref_normalize(thought_means, **kw))
        if answer_baseline == "prompt":
            flat = ref_normalize([r for thought in prompt for r in thought], **kw)
            answer_adv.append([flat[k * num_answers : (k + 1) * num_answers] for k in range(num_thoughts)])
        else:
            answer_adv.append([ref_normalize(list(thought), **kw) for thought in prompt])
    return thought_adv, answer_adv


def random_rewards(kind: str, shape, generator: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(shape, generator=generator, dtype=F64)
    if kind == "binary":  # many constant groups
        return torch.randint(0, 2, shape, generator=generator).to(F64)
    return torch.randint(0, 3, shape, generator=generator).to(F64) / 2  # {0, 0.5, 1}


SHAPES = [(1, 1, 1), (3, 1, 4), (2, 5, 1), (4, 6, 8), (2, 3, 2), (5, 2, 3)]


KINDS = ["normal", "binary", "thirds"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_loop_reference(shape, kind):
    generator = torch.Generator().manual_seed(10 * SHAPES.index(shape) + KINDS.index(kind))
    rewards = random_rewards(kind, shape, generator)
    for answer_baseline, scale_by_std, unbiased, eps in itertools.product(
        ["prompt", "thought"], [True, False], [False, True], [1e-6, 0.0]
    ):
        kw = dict(answer_baseline=answer_baseline, scale_by_std=scale_by_std, eps=eps, unbiased=unbiased)
        thought_adv, answer_adv = grpo_ma_advantages(rewards, **kw)
        ref_thought, ref_answer = ref_grpo_ma(rewards.tolist(), **kw)
        assert thought_adv.shape == shape[:2] and answer_adv.shape == shape
        close(thought_adv, ref_thought)
        close(answer_adv, ref_answer)


# --- hand-computed values --------------------------------------------------------------------------------

# Prompt 0: thought 0 answers {1, 0}, thought 1 answers {0, 0}. Prompt 1: every answer 1 (constant).
HAND_REWARDS = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]], dtype=F64)


def test_hand_values_population_std():
    # Thought means (0.5, 0): mean 0.25, population std 0.25 -> (+1, -1).
    # Prompt answers (1, 0, 0, 0): mean 0.25, population var (0.75^2 + 3 * 0.25^2) / 4 = 3/16, std sqrt(3)/4
    #   -> 0.75 / (sqrt(3)/4) = sqrt(3), -0.25 / (sqrt(3)/4) = -1/sqrt(3).
    # Thought answers (1, 0): mean 0.5, std 0.5 -> (+1, -1); (0, 0) constant -> (0, 0).
    thought_adv, answer_adv = grpo_ma_advantages(HAND_REWARDS, answer_baseline="prompt", eps=0.0)
    close(thought_adv, [[1.0, -1.0], [0.0, 0.0]])
    close(answer_adv, [[[SQRT3, -1 / SQRT3], [-1 / SQRT3, -1 / SQRT3]], [[0.0, 0.0], [0.0, 0.0]]])

    thought_adv, answer_adv = grpo_ma_advantages(HAND_REWARDS, answer_baseline="thought", eps=0.0)
    close(thought_adv, [[1.0, -1.0], [0.0, 0.0]])
    close(answer_adv, [[[1.0, -1.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])


def test_hand_values_unbiased_std():
    # Thought means (0.5, 0): sample var (2 * 0.25^2) / 1 = 1/8, std 1/(2 sqrt 2) -> +-1/sqrt 2.
    # Prompt answers (1, 0, 0, 0): sample var 0.75 / 3 = 1/4, std 1/2 -> (1.5, -0.5, -0.5, -0.5).
    # Thought answers (1, 0): sample var 0.5, std 1/sqrt 2 -> +-0.5 * sqrt 2 = +-1/sqrt 2.
    thought_adv, answer_adv = grpo_ma_advantages(
        HAND_REWARDS, answer_baseline="prompt", eps=0.0, unbiased=True
    )
    close(thought_adv, [[1 / SQRT2, -1 / SQRT2], [0.0, 0.0]])
    close(answer_adv, [[[1.5, -0.5], [-0.5, -0.5]], [[0.0, 0.0], [0.0, 0.0]]])

    thought_adv, answer_adv = grpo_ma_advantages(
        HAND_REWARDS, answer_baseline="thought", eps=0.0, unbiased=True
    )
    close(thought_adv, [[1 / SQRT2, -1 / SQRT2], [0.0, 0.0]])
    close(answer_adv, [[[1 / SQRT2, -1 / SQRT2], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])


def test_hand_values_centred_only():
    thought_adv, answer_adv = grpo_ma_advantages(HAND_REWARDS, answer_baseline="prompt", scale_by_std=False)
    close(thought_adv, [[0.25, -0.25], [0.0, 0.0]])
    close(answer_adv, [[[0.75, -0.25], [-0.25, -0.25]], [[0.0, 0.0], [0.0, 0.0]]])
    thought_adv, answer_adv = grpo_ma_advantages(HAND_REWARDS, answer_baseline="thought", scale_by_std=False)
    close(thought_adv, [[0.25, -0.25], [0.0, 0.0]])
    close(answer_adv, [[[0.5, -0.5], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])


def test_hand_values_default_eps():
    # Default eps = 1e-6 is added to the std: thought advantage 0.25 / (0.25 + 1e-6).
    thought_adv, answer_adv = grpo_ma_advantages(HAND_REWARDS)
    a = 0.25 / 0.250001
    close(thought_adv, [[a, -a], [0.0, 0.0]])
    s = SQRT3 / 4 + 1e-6
    close(answer_adv[0], [[0.75 / s, -0.25 / s], [-0.25 / s, -0.25 / s]])


def test_hand_values_three_thoughts_uneven():
    # One prompt, K = 3, M = 2: thought means (1, 0.5, 0) -> mean 0.5, population std sqrt(1/6).
    rewards = torch.tensor([[[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]], dtype=F64)
    thought_adv, _ = grpo_ma_advantages(rewards, eps=0.0)
    close(thought_adv, [[math.sqrt(1.5), 0.0, -math.sqrt(1.5)]])


def test_grpo_advantages_hand_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=F64)
    close(grpo_advantages(rewards, eps=0.0), [[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    close(
        grpo_advantages(rewards, eps=0.0, unbiased=True),
        [[SQRT3 / 2, -SQRT3 / 2, -SQRT3 / 2, SQRT3 / 2], [0.0] * 4],
    )


# --- M = 1 is GRPO -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_single_answer_is_plain_grpo_exactly(dtype):
    generator = torch.Generator().manual_seed(0)
    for rewards in [
        torch.randn(4, 6, 1, generator=generator),
        torch.randint(0, 2, (8, 5, 1), generator=generator),
    ]:
        rewards = rewards.to(dtype)
        for scale_by_std, unbiased in itertools.product([True, False], [False, True]):
            kw = dict(scale_by_std=scale_by_std, unbiased=unbiased)
            thought_adv, answer_adv = grpo_ma_advantages(rewards, answer_baseline="prompt", **kw)
            grpo = grpo_advantages(rewards[..., 0], **kw)
            assert torch.equal(thought_adv, grpo)
            assert torch.equal(answer_adv[..., 0], grpo)


def test_single_answer_with_thought_baseline_gives_zero_answer_advantages():
    rewards = torch.randn(3, 4, 1, dtype=F64)
    _, answer_adv = grpo_ma_advantages(rewards, answer_baseline="thought")
    assert torch.equal(answer_adv, torch.zeros_like(answer_adv))


# --- invariances ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer_baseline", ["prompt", "thought"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_shift_per_prompt_leaves_advantages_unchanged(answer_baseline, unbiased):
    generator = torch.Generator().manual_seed(1)
    for rewards in [
        torch.rand(5, 4, 3, generator=generator, dtype=F64),
        torch.randint(0, 2, (5, 4, 3), generator=generator).to(F64),
    ]:
        shift = 20 * torch.rand(5, 1, 1, generator=generator, dtype=F64) - 10  # one constant per prompt
        for scale_by_std in [True, False]:
            kw = dict(answer_baseline=answer_baseline, scale_by_std=scale_by_std, unbiased=unbiased)
            base = grpo_ma_advantages(rewards, **kw)
            shifted = grpo_ma_advantages(rewards + shift, **kw)
            close(shifted[0], base[0])
            close(shifted[1], base[1])


def test_shift_per_thought_leaves_thought_baseline_answer_advantages_unchanged():
    rewards = torch.rand(3, 4, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    shift = torch.linspace(-3, 3, 12, dtype=F64).reshape(3, 4, 1)
    _, base = grpo_ma_advantages(rewards, answer_baseline="thought")
    _, shifted = grpo_ma_advantages(rewards + shift, answer_baseline="thought")
    close(shifted, base)
    _, prompt_base = grpo_ma_advantages(rewards, answer_baseline="prompt")
    _, prompt_shifted = grpo_ma_advantages(rewards + shift, answer_baseline="prompt")
    assert (prompt_shifted - prompt_base).abs().max() > 0.1  # the prompt baseline does see the shift


@pytest.mark.parametrize("answer_baseline", ["prompt", "thought"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_positive_scale_per_prompt(answer_baseline, unbiased):
    # eps = 0 so scaling is exactly neutral with scale_by_std (with eps > 0 it changes values by ~eps/std).
    generator = torch.Generator().manual_seed(3)
    rewards = torch.rand(5, 4, 3, generator=generator, dtype=F64)
    scale = 0.01 + 100 * torch.rand(5, 1, 1, generator=generator, dtype=F64)
    kw = dict(answer_baseline=answer_baseline, unbiased=unbiased, eps=0.0)
    base, scaled = grpo_ma_advantages(rewards, **kw), grpo_ma_advantages(rewards * scale, **kw)
    close(scaled[0], base[0])
    close(scaled[1], base[1])
    # Centred only: advantages scale with the rewards.
    kw["scale_by_std"] = False
    base, scaled = grpo_ma_advantages(rewards, **kw), grpo_ma_advantages(rewards * scale, **kw)
    close(scaled[0], base[0] * scale[:, :, 0])
    close(scaled[1], base[1] * scale)


@pytest.mark.parametrize("shape", [(2, 3, 4), (1, 1, 1), (2, 1, 3), (3, 4, 1)])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -7.3])
def test_constant_groups_give_exact_zeros(shape, value):
    # 0.1: the float mean of three 0.1s is 0.10000000000000002, so a naive (x - mean) would leave a residue.
    rewards = torch.full(shape, value, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no degrees-of-freedom warning for size-1 groups with unbiased=True
        for answer_baseline, scale_by_std, unbiased, eps in itertools.product(
            ["prompt", "thought"], [True, False], [False, True], [1e-6, 0.0]
        ):
            thought_adv, answer_adv = grpo_ma_advantages(
                rewards,
                answer_baseline=answer_baseline,
                scale_by_std=scale_by_std,
                unbiased=unbiased,
                eps=eps,
            )
            assert torch.equal(thought_adv, torch.zeros(shape[:2], dtype=F64))
            assert torch.equal(answer_adv, torch.zeros(shape, dtype=F64))


def test_constant_residue_exists_without_the_guard():
    # Documents why the max == min guard is there: the naive centring is not exactly zero.
    values = torch.full((3,), 0.1, dtype=F64)
    assert (values - values.mean()).abs().max() > 0
    assert torch.equal(group_normalize(values, scale_by_std=False), torch.zeros(3, dtype=F64))


def test_constant_prompt_next_to_varied_prompt():
    rewards = torch.tensor([[[0.3, 0.3], [0.3, 0.3]], [[0.0, 1.0], [1.0, 1.0]]], dtype=F64)
    thought_adv, answer_adv = grpo_ma_advantages(rewards, eps=0.0, unbiased=True)
    assert torch.equal(thought_adv[0], torch.zeros(2, dtype=F64))
    assert torch.equal(answer_adv[0], torch.zeros(2, 2, dtype=F64))
    assert torch.isfinite(thought_adv).all() and torch.isfinite(answer_adv).all()
    close(thought_adv[1], [-1 / SQRT2, 1 / SQRT2])


# --- group_normalize details and validation ---------------------------------------------------------------


def test_group_normalize_other_dim_matches_transpose():
    values = torch.randn(5, 7, generator=torch.Generator().manual_seed(4), dtype=F64)
    for unbiased in [False, True]:
        along_rows = group_normalize(values, dim=0, unbiased=unbiased)
        assert torch.equal(along_rows, group_normalize(values.T.contiguous(), dim=-1, unbiased=unbiased).T)


def test_group_normalize_promotes_integers():
    out = group_normalize(torch.tensor([[1, 0, 1, 0]]), eps=0.0)
    assert out.dtype == torch.get_default_dtype()
    assert torch.equal(out, torch.tensor([[1.0, -1.0, 1.0, -1.0]]))


def test_float32_population_std_of_binary_pair_is_exact():
    thought_adv, answer_adv = grpo_ma_advantages(torch.tensor([[[1.0], [0.0]]]), eps=0.0)
    assert torch.equal(thought_adv, torch.tensor([[1.0, -1.0]]))
    assert torch.equal(answer_adv, torch.tensor([[[1.0], [-1.0]]]))


@pytest.mark.parametrize("shape", [(4,), (2, 3), (2, 3, 4, 5)])
def test_rejects_wrong_rank(shape):
    with pytest.raises(ValueError, match=r"\[B, K, M\]"):
        grpo_ma_advantages(torch.zeros(shape))


def test_grpo_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        grpo_advantages(torch.zeros(2, 3, 4))


def test_rejects_unknown_answer_baseline():
    with pytest.raises(ValueError, match="'prompt', 'thought'.*'answer'"):
        grpo_ma_advantages(torch.zeros(1, 2, 2), answer_baseline="answer")


# --- the estimator registry (algorithm.advantage_estimator) ----------------------------------------------

# One prompt, K = 3 thoughts x M = 2 answers: thought means {1, 0.5, 0}; the six rewards are half 1, half 0.
TREE_REWARDS = torch.tensor([[[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]], dtype=F64)
SQRT15, SQRT03 = math.sqrt(1.5), math.sqrt(0.3)
# (estimator, numerics) -> (thought_adv, answer_adv), by hand (eps = 0):
# grpo_ma thoughts: means {1, .5, 0} - .5 = {.5, 0, -.5}; population std sqrt(1/6) -> +-sqrt(1.5); unbiased .5 -> +-1.
# answers over all six: r - .5 = +-.5; population std .5 -> +-1; unbiased sqrt(.3) -> +-.5/sqrt(.3).
# grpo (flat): the same answers; a thought's tokens carry, in each of its M sequences, that sequence's answer
# advantage (thought_adv [B, K, M] == answer_adv).
ESTIMATOR_TABLE = [
    ("grpo_ma", dict(scale_by_std=True, unbiased=False), [SQRT15, 0, -SQRT15], [1, 1, 1, -1, -1, -1]),
    ("grpo_ma", dict(scale_by_std=True, unbiased=True), [1, 0, -1], [0.5 / SQRT03] * 3 + [-0.5 / SQRT03] * 3),
    ("grpo_ma", dict(scale_by_std=False, unbiased=False), [0.5, 0, -0.5], [0.5] * 3 + [-0.5] * 3),
    ("grpo", dict(scale_by_std=True, unbiased=False), [[1, 1], [1, -1], [-1, -1]], [1, 1, 1, -1, -1, -1]),
    ("grpo", dict(scale_by_std=True, unbiased=True), [[0.5 / SQRT03] * 2, [0.5 / SQRT03, -0.5 / SQRT03], [-0.5 / SQRT03] * 2], [0.5 / SQRT03] * 3 + [-0.5 / SQRT03] * 3),
    ("grpo", dict(scale_by_std=False, unbiased=False), [[0.5, 0.5], [0.5, -0.5], [-0.5, -0.5]], [0.5] * 3 + [-0.5] * 3),
]


@pytest.mark.parametrize("name, numerics, thought, answer", ESTIMATOR_TABLE)
def test_each_estimator_against_a_hand_computed_table(name, numerics, thought, answer):
    thought_adv, answer_adv = compute_advantages(name, TREE_REWARDS, answer_baseline="prompt", eps=0.0, **numerics)
    close(thought_adv, [thought])
    close(answer_adv, torch.tensor(answer, dtype=F64).reshape(1, 3, 2))


def test_the_registry_names_its_estimators_and_the_default_is_grpo_ma():
    from vlm_grpo_ma.run.config import AlgorithmConfig

    assert ADVANTAGE_ESTIMATORS == {"grpo_ma": grpo_ma_advantages, "grpo": flat_grpo_advantages}
    assert AlgorithmConfig().advantage_estimator == "grpo_ma"


def test_an_unknown_estimator_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpo-ma'; known: grpo_ma, grpo"):
        compute_advantages("grpo-ma", TREE_REWARDS, answer_baseline="prompt")


def ref_flat_grpo(rewards: list, *, scale_by_std: bool, eps: float, unbiased: bool):
    """Flat GRPO by loops: each prompt's K*M answers normalised together; a thought's tokens in sequence (k, m)
    get that sequence's advantage."""
    thought_adv, answer_adv = [], []
    for prompt in rewards:
        num_answers = len(prompt[0])
        flat = ref_normalize([r for thought in prompt for r in thought], scale_by_std=scale_by_std, eps=eps, unbiased=unbiased)
        answers = [flat[k * num_answers : (k + 1) * num_answers] for k in range(len(prompt))]
        answer_adv.append(answers)
        thought_adv.append([list(a) for a in answers])
    return thought_adv, answer_adv


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_flat_grpo_matches_loop_reference(shape, kind):
    generator = torch.Generator().manual_seed(100 + 10 * SHAPES.index(shape) + KINDS.index(kind))
    rewards = random_rewards(kind, shape, generator)
    for scale_by_std, unbiased, eps in itertools.product([True, False], [False, True], [1e-6, 0.0]):
        kw = dict(scale_by_std=scale_by_std, eps=eps, unbiased=unbiased)
        thought_adv, answer_adv = flat_grpo_advantages(rewards, answer_baseline="prompt", **kw)
        ref_thought, ref_answer = ref_flat_grpo(rewards.tolist(), **kw)
        assert thought_adv.shape == shape and answer_adv.shape == shape
        close(thought_adv, ref_thought)
        close(answer_adv, ref_answer)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_with_one_answer_per_thought_both_estimators_are_plain_grpo_exactly(dtype):
    rewards = torch.rand(5, 6, 1, generator=torch.Generator().manual_seed(7), dtype=dtype)
    ma_thought, ma_answer = grpo_ma_advantages(rewards, answer_baseline="prompt")
    flat_thought, flat_answer = flat_grpo_advantages(rewards)
    assert torch.equal(flat_thought[..., 0], ma_thought) and torch.equal(flat_answer, ma_answer)


def test_flat_grpo_has_no_thought_baseline():
    with pytest.raises(ValueError, match="answer_baseline must be 'prompt', got 'thought'"):
        flat_grpo_advantages(TREE_REWARDS, answer_baseline="thought")
