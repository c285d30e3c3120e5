"""Tests for vlm_grpo_ma.algorithm.loss: hand-computed surrogate and k3 values, micro-batch additivity, gradients.

Tolerances: float64 throughout with 1e-12 (the computations are a handful of flops, rounding ~1e-16;
ratios built as exp(log(r)) are off by ~1 ulp). A wrong branch, clip bound or normaliser moves values by
>= 1e-2. The k3 >= 0 check and the gradient-equals-advantage checks are exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from vlm_grpo_ma.algorithm.loss import (
    MAX_LOG_RATIO,
    clipped_surrogate,
    kl_k3,
    policy_loss,
    truncated_importance_weights,
)

F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)
LN2 = math.log(2.0)
CLIP = dict(clip_low=0.2, clip_high=0.28)


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), **TOL)


def random_step(num_rows: int, num_tokens: int, seed: int):
    """A plausible micro-batch: log-probs near each other, a padding tail, per-row advantages."""
    generator = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(num_rows, num_tokens, generator=generator, dtype=F64)  # [N, T]
    logprobs = old + 0.4 * torch.randn(
        num_rows, num_tokens, generator=generator, dtype=F64
    )  # ratios ~ e^+-0.4
    ref = old + 0.3 * torch.randn(num_rows, num_tokens, generator=generator, dtype=F64)
    advantages = torch.randn(num_rows, 1, generator=generator, dtype=F64).expand(num_rows, num_tokens)
    lengths = torch.randint(1, num_tokens + 1, (num_rows, 1), generator=generator)
    weights = (torch.arange(num_tokens) < lengths).to(F64)  # [N, T]
    weights[0, 0] = 0.25  # fractional weights (a thought shared by 4 answers) are allowed
    return logprobs, old, ref, advantages.contiguous(), weights


# --- clipped surrogate: hand values ------------------------------------------------------------------------

# (ratio, advantage, expected loss, expected clipped) with clip_low = 0.2, clip_high = 0.28: range [0.8, 1.28].
SURROGATE_CASES = [
    (1.5, 1.0, -1.28, True),  # above range, A > 0: clipped at 1.28
    (1.5, -1.0, 1.5, False),  # above range, A < 0: unclipped term is the min (pessimistic)
    (0.5, 1.0, -0.5, False),  # below range, A > 0: unclipped term is the min
    (0.5, -1.0, 0.8, True),  # below range, A < 0: clipped at 0.8
    (1.1, 2.0, -2.2, False),  # inside
    (0.9, -3.0, 2.7, False),  # inside
    (1.25, 1.0, -1.25, False),  # inside only because clip_high = 0.28 > 0.2 (asymmetric)
    (0.79, -1.0, 0.8, True),  # just below 1 - clip_low
    (1.3, 0.5, -0.64, True),  # just above 1 + clip_high: 1.28 * 0.5
    (1.5, 0.0, 0.0, False),  # zero advantage is never "clipped"
    (1.0, 1.7, -1.7, False),  # on-policy
]


def test_clipped_surrogate_hand_values():
    ratios = torch.tensor([[c[0] for c in SURROGATE_CASES]], dtype=F64)
    advantages = torch.tensor([[c[1] for c in SURROGATE_CASES]], dtype=F64)
    old = torch.full_like(ratios, -1.7)
    loss, clipped = clipped_surrogate(old + ratios.log(), old, advantages, **CLIP)
    close(loss, [[c[2] for c in SURROGATE_CASES]])
    assert clipped.dtype == torch.bool
    assert clipped.tolist() == [[c[3] for c in SURROGATE_CASES]]


def test_symmetric_clip_clips_where_asymmetric_does_not():
    ratio = torch.tensor([[1.25]], dtype=F64)
    loss, clipped = clipped_surrogate(
        ratio.log(), torch.zeros_like(ratio), torch.ones_like(ratio), clip_low=0.2, clip_high=0.2
    )
    close(loss, [[-1.2]])
    assert clipped.item()


def test_clipped_surrogate_clamps_log_ratio():
    # log-ratio 100 with A < 0: the unclipped branch is chosen; exp(100) would be 2.7e43 (inf in fp32).
    logprobs = torch.tensor([[100.0, -100.0]], dtype=F64, requires_grad=True)
    advantages = torch.tensor([[-2.0, 3.0]], dtype=F64)
    loss, _ = clipped_surrogate(logprobs, torch.zeros(1, 2, dtype=F64), advantages, **CLIP)
    close(loss, [[2.0 * math.exp(MAX_LOG_RATIO), -3.0 * math.exp(-MAX_LOG_RATIO)]])
    loss.sum().backward()
    assert torch.equal(logprobs.grad, torch.zeros(1, 2, dtype=F64))  # beyond the clamp: no gradient

    loss32, _ = clipped_surrogate(torch.tensor([[100.0]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), **CLIP)
    assert torch.isfinite(loss32).all()


def test_clip_arguments_validated():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_low"):
        clipped_surrogate(x, x, x, clip_low=1.5, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_high"):
        clipped_surrogate(x, x, x, clip_low=0.2, clip_high=-0.1)


# --- k3 -----------------------------------------------------------------------------------------------------


def test_k3_hand_values():
    ref = torch.tensor([[LN2, -LN2, 0.0, 1.0, 50.0, -50.0]], dtype=F64)
    logprobs = torch.zeros_like(ref)
    expected = [
        2.0 - LN2 - 1.0,  # 1 - ln 2
        0.5 + LN2 - 1.0,  # ln 2 - 1/2
        0.0,
        math.e - 2.0,
        math.expm1(MAX_LOG_RATIO) - MAX_LOG_RATIO,  # clamped at +20
        math.expm1(-MAX_LOG_RATIO) + MAX_LOG_RATIO,  # clamped at -20
    ]
    close(kl_k3(logprobs, ref), [expected])
    # Only the difference matters.
    close(kl_k3(logprobs - 2.5, ref - 2.5), [expected])


def test_k3_exactly_zero_at_equality_and_nonnegative():
    generator = torch.Generator().manual_seed(0)
    for dtype in [torch.float32, F64]:
        logprobs = -5 * torch.rand(64, 64, generator=generator).to(dtype)
        assert torch.equal(kl_k3(logprobs, logprobs), torch.zeros_like(logprobs))
        for scale in [
            1e-9,
            1e-7,
            1e-4,
            1e-1,
            10.0,
            100.0,
        ]:  # tiny log-ratios are where exp(r) - r - 1 < 0 can happen
            ref = logprobs + scale * torch.randn(64, 64, generator=generator).to(dtype)
            assert (kl_k3(logprobs, ref) >= 0).all()


def test_k3_expectation_under_pi_is_exact_kl():
    # E_{x ~ pi}[k3(x)] = sum_x pi(x) (pi_ref(x)/pi(x) - log(pi_ref(x)/pi(x)) - 1) = 1 + KL(pi || pi_ref) - 1.
    generator = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(torch.randn(7, generator=generator, dtype=F64), dim=0)
    ref = torch.log_softmax(torch.randn(7, generator=generator, dtype=F64), dim=0)
    expectation = (logp.exp() * kl_k3(logp, ref)).sum()
    kl = (logp.exp() * (logp - ref)).sum()
    close(expectation, kl)


# --- policy_loss -------------------------------------------------------------------------------------------


def hand_batch():
    # One row, four positions: ratios 1.5, 0.5, 1, and a padding position.
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=F64)
    logprobs = old + torch.tensor([[math.log(1.5), math.log(0.5), 0.0, 0.7]], dtype=F64)
    ref = logprobs + torch.tensor([[LN2, -LN2, 0.0, 4.0]], dtype=F64)
    advantages = torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=F64)
    weights = torch.tensor([[1.0, 0.5, 1.0, 0.0]], dtype=F64)
    return logprobs, old, ref, advantages, weights


def test_policy_loss_hand_values():
    logprobs, old, ref, advantages, weights = hand_batch()
    # surrogate: -1.28 (clipped), +0.8 (clipped), -2.0, padding ignored; weighted: -1.28 + 0.4 - 2.0 = -2.88.
    loss, stats = policy_loss(logprobs, old, advantages, weights, **CLIP, total_weight=5.0)
    close(loss, -2.88 / 5.0)
    close(stats["clip_fraction_sum"], 1.5)
    close(stats["weight_sum"], 2.5)
    close(stats["kl_sum"], 0.0)

    # k3: (1 - ln 2), (ln 2 - 1/2), 0; weighted sum (1 - ln 2) + 0.5 (ln 2 - 1/2) = 0.75 - 0.5 ln 2.
    kl_sum = 0.75 - 0.5 * LN2
    loss, stats = policy_loss(
        logprobs, old, advantages, weights, **CLIP, total_weight=5.0, kl_coef=0.1, ref_logprobs=ref
    )
    close(loss, (-2.88 + 0.1 * kl_sum) / 5.0)
    close(stats["kl_sum"], kl_sum)
    close(stats["clip_fraction_sum"], 1.5)

    # kl_coef = 0 with a reference: same loss as without, KL still reported.
    loss, stats = policy_loss(logprobs, old, advantages, weights, **CLIP, total_weight=5.0, ref_logprobs=ref)
    close(loss, -2.88 / 5.0)
    close(stats["kl_sum"], kl_sum)


def test_stats_are_detached_sums():
    logprobs, old, ref, advantages, weights = hand_batch()
    logprobs.requires_grad_(True)
    _, stats = policy_loss(
        logprobs, old, advantages, weights, **CLIP, total_weight=1.0, kl_coef=0.1, ref_logprobs=ref
    )
    assert set(stats) == {"clip_fraction_sum", "kl_sum", "nll_sum", "pg_loss_sum", "log_ratio_abs_max", "weight_sum"}
    for value in stats.values():
        assert value.ndim == 0 and value.is_floating_point() and not value.requires_grad


def test_model_dependent_stats_hand_values():
    """nll and pg_loss depend on the log-probs themselves (the surrogate at ratio 1 does not); the largest
    |log-ratio| skips the padding position (0.7 there, above ln 2)."""
    logprobs, old, ref, advantages, weights = hand_batch()
    _, stats = policy_loss(logprobs, old, advantages, weights, **CLIP, total_weight=1.0)
    ln15 = math.log(1.5)
    # trained log-probs: -1 + ln 1.5, -2 - ln 2, -0.5 with weights 1, 0.5, 1
    close(stats["nll_sum"], 2.5 - ln15 + 0.5 * LN2)
    # -(1 * (-1 + ln 1.5) + 0.5 * (-1) * (-2 - ln 2) + 1 * 2 * (-0.5))
    close(stats["pg_loss_sum"], 1.0 - ln15 - 0.5 * LN2)
    close(stats["log_ratio_abs_max"], LN2)
    _, at_ratio_one = policy_loss(logprobs, logprobs.detach(), advantages, weights, **CLIP, total_weight=1.0)
    assert at_ratio_one["log_ratio_abs_max"] == 0


def micro_batches(tensors, sizes):
    return zip(*(torch.split(t, sizes) for t in tensors), strict=True)


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_micro_batches_sum_to_full_batch_loss_and_gradient(kl_coef):
    logprobs, old, ref, advantages, weights = random_step(num_rows=9, num_tokens=11, seed=2)
    total_weight = weights.sum()
    kw = dict(**CLIP, total_weight=total_weight, kl_coef=kl_coef, ref_logprobs=ref)

    full_logprobs = logprobs.clone().requires_grad_(True)
    full_loss, full_stats = policy_loss(
        full_logprobs, old, advantages, weights, **{**kw, "ref_logprobs": ref}
    )
    full_loss.backward()

    micro_logprobs = logprobs.clone().requires_grad_(True)
    sizes = [2, 4, 1, 2]
    summed_loss = torch.zeros((), dtype=F64)
    summed_stats = {name: torch.zeros((), dtype=F64) for name in full_stats}
    for lp, o, r, a, w in micro_batches([micro_logprobs, old, ref, advantages, weights], sizes):
        loss, stats = policy_loss(lp, o, a, w, **{**kw, "ref_logprobs": r})
        loss.backward()  # gradient accumulation, as the trainer does it
        summed_loss += loss.detach()
        for name in stats:
            if name.endswith("_max"):  # a maximum over micro-batches, not a sum
                summed_stats[name] = torch.maximum(summed_stats[name], stats[name])
            else:
                summed_stats[name] += stats[name]

    close(summed_loss, full_loss.detach())
    torch.testing.assert_close(micro_logprobs.grad, full_logprobs.grad, **TOL)
    for name in full_stats:
        close(summed_stats[name], full_stats[name])
    close(full_stats["weight_sum"], total_weight)

    # The test can fail: normalising each micro-batch by its own weight (a per-micro-batch mean) differs.
    wrong = sum(
        policy_loss(lp, o, a, w, **{**kw, "ref_logprobs": r, "total_weight": w.sum()})[0].detach()
        / len(sizes)
        for lp, o, r, a, w in micro_batches([logprobs, old, ref, advantages, weights], sizes)
    )
    assert (wrong - full_loss.detach()).abs() > 1e-3


def test_gradient_at_ratio_one_is_minus_advantage_times_weight():
    # Two thoughts x two answers, 3 thought tokens + 2 answer tokens + 1 padding per row. Each thought appears
    # in front of both its answers, so its tokens carry weight 1/M = 0.5 in each copy (counted once in all).
    thought_adv = torch.tensor([0.7, -0.7], dtype=F64)
    answer_adv = torch.tensor([[1.2, -0.4], [-0.4, -0.4]], dtype=F64)
    advantages = torch.zeros(4, 6, dtype=F64)
    weights = torch.zeros(4, 6, dtype=F64)
    for row, (k, m) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        advantages[row, :3] = thought_adv[k]
        advantages[row, 3:5] = answer_adv[k, m]
        weights[row, :3] = 0.5
        weights[row, 3:5] = 1.0
    advantages[:, 5] = 9.0  # garbage on padding: weight 0 must make it irrelevant
    old = -torch.rand(4, 6, generator=torch.Generator().manual_seed(3), dtype=F64)
    total_weight = 3.0 * weights.sum()  # as if this were one of three equal micro-batches

    logprobs = old.clone().requires_grad_(True)
    # With ref == logprobs the k3 gradient (1 - exp(ref - logp)) is 0 too, so kl_coef must not change it.
    for kl_coef, ref in [(0.0, None), (0.3, old.clone())]:
        logprobs.grad = None
        loss, stats = policy_loss(
            logprobs,
            old,
            advantages,
            weights,
            **CLIP,
            total_weight=total_weight,
            kl_coef=kl_coef,
            ref_logprobs=ref,
        )
        loss.backward()
        expected = -advantages * weights / total_weight
        torch.testing.assert_close(logprobs.grad, expected, **TOL)
        assert torch.equal(logprobs.grad[:, 5], torch.zeros(4, dtype=F64))
        close(logprobs.grad[0, 0], -0.7 * 0.5 / total_weight)  # a thought token gets its thought's advantage
        close(logprobs.grad[0, 3], -1.2 / total_weight)  # an answer token gets its answer's advantage
        # Summed over the M copies, a thought token's gradient is that of one token with weight 1.
        close(logprobs.grad[0, :3] + logprobs.grad[1, :3], torch.full((3,), -0.7, dtype=F64) / total_weight)
        close(stats["clip_fraction_sum"], 0.0)
        close(stats["kl_sum"], 0.0)


def test_non_finite_values_on_padding_do_not_poison_the_loss():
    logprobs, old, ref, advantages, weights = hand_batch()
    expected_loss, _ = policy_loss(
        logprobs, old, advantages, weights, **CLIP, total_weight=5.0, kl_coef=0.1, ref_logprobs=ref
    )
    logprobs = logprobs.clone()
    logprobs[0, 3] = math.nan
    old = old.clone()
    old[0, 3] = math.nan
    ref = ref.clone()
    ref[0, 3] = -math.inf
    advantages = advantages.clone()
    advantages[0, 3] = math.nan
    logprobs.requires_grad_(True)
    loss, stats = policy_loss(
        logprobs, old, advantages, weights, **CLIP, total_weight=5.0, kl_coef=0.1, ref_logprobs=ref
    )
    close(loss.detach(), expected_loss)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 3].item() == 0.0
    assert all(torch.isfinite(v) for v in stats.values())


def test_policy_loss_validation():
    x = torch.zeros(2, 3, dtype=F64)
    w = torch.ones(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, x, w, **CLIP, total_weight=6.0, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        policy_loss(x, x, x, w, **CLIP, total_weight=6.0, kl_coef=-0.1, ref_logprobs=x)
    with pytest.raises(ValueError, match="total_weight"):
        policy_loss(x, x, x, w, **CLIP, total_weight=0.0)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 1\)"):
        policy_loss(x, x, torch.zeros(2, 1, dtype=F64), w, **CLIP, total_weight=6.0)
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        policy_loss(x, x, x, w, **CLIP, total_weight=6.0, ref_logprobs=torch.zeros(3, 2, dtype=F64))


def test_truncated_importance_weights_hand_values():
    """min(exp(old - engine), cap): 1 where trainer and engine agree, e^1 capped at 2, e^-1 below 1 kept."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    engine = torch.tensor([[-1.0, -3.0, 0.5]])
    weights = truncated_importance_weights(old, engine, cap=2.0)
    assert weights.tolist()[0] == pytest.approx([1.0, 2.0, math.exp(-1.0)], rel=1e-6)
    with pytest.raises(ValueError, match="cap must be >= 1, got 0.5"):
        truncated_importance_weights(old, engine, cap=0.5)


def test_importance_weights_scale_each_tokens_surrogate_not_its_kl():
    """With weights w the loss is sum(token_weight * (w * surrogate + kl_coef * k3)): at ratio 1 the surrogate of
    a token is -A, so the surrogate part is -sum(token_weight * w * A) by hand; the KL part is unchanged."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    advantages = torch.tensor([[1.0, -2.0, 0.5]])
    token_weights = torch.tensor([[0.2, 0.3, 0.5]])
    ref = torch.tensor([[-1.2, -1.5, -0.4]])
    w = torch.tensor([[2.0, 0.5, 1.0]])
    plain, _ = policy_loss(logprobs, logprobs, advantages, token_weights, **CLIP, total_weight=1.0, importance_weights=w)
    assert float(plain) == pytest.approx(-(0.2 * 2.0 * 1.0 + 0.3 * 0.5 * -2.0 + 0.5 * 1.0 * 0.5), rel=1e-6)
    with_kl, _ = policy_loss(logprobs, logprobs, advantages, token_weights, **CLIP, total_weight=1.0, importance_weights=w,
                             kl_coef=0.1, ref_logprobs=ref)  # fmt: skip
    kl = float((token_weights * kl_k3(logprobs, ref)).sum())
    assert float(with_kl) - float(plain) == pytest.approx(0.1 * kl, rel=1e-5)
