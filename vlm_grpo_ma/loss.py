"""The GRPO / GRPO-MA policy loss: clipped surrogate, k3 KL estimator, token-level aggregation.

Pure tensor functions; numbers in, tensors out, never a config object. Shapes: ``N`` sequences (rows) in a
micro-batch, ``T`` token positions per row. Every per-token input is ``[N, T]``: log-probs of the sampled
tokens under the current policy (with grad), under the sampling policy (``old``), under the reference
policy (``ref``), the per-token advantage (already broadcast: thought tokens carry their thought's
advantage, answer tokens their answer's), and a float token weight.

Aggregation is token-level over the *whole optimisation step* (DAPO, arXiv 2503.14476, "token-level policy
gradient loss"): every counted token of the step has the same weight in the mean, whatever its sequence's
length or micro-batch. The caller passes ``total_weight`` = the sum of token weights over all micro-batches
of the step, so the micro-batch losses add up to the full-batch loss exactly and gradient accumulation is
the same computation as one big batch.
"""

from __future__ import annotations

import torch

# Log-ratios are clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before exp (as verl's ``compute_policy_loss``
# and ``kl_penalty`` do). exp(20) ~ 4.9e8 is finite in fp32 and bf16 (not in fp16, max 65504: compute
# log-probs in fp32); exp(89) already overflows fp32 to inf, and inf * 0 (a zero advantage) is NaN, which
# would poison the whole step. A log-ratio beyond +-20 means the sampler and trainer disagree wildly
# (stale old log-probs, a numerics mismatch); the clamp zeroes that token's gradient rather than letting
# it explode.
MAX_LOG_RATIO = 20.0


def kl_k3(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(r) - r - 1`` with ``r = ref_logprobs - logprobs``.

    Shapes: ``logprobs[N, T]``, ``ref_logprobs[N, T]`` -> ``[N, T]``.

    Schulman, "Approximating KL Divergence" (2020): unbiased for KL(pi || pi_ref) when tokens are sampled
    from pi, always >= 0, low variance; the estimator GRPO uses (DeepSeekMath eq. 4).

    Decisions: ``r`` is clamped to ``[-max_log_ratio, max_log_ratio]`` before ``exp`` (see
    ``MAX_LOG_RATIO``); beyond the clamp the value saturates and the gradient is 0. We compute
    ``expm1(r) - r`` rather than ``exp(r) - r - 1``: it is more accurate for small ``r`` (no cancellation
    against 1) and, because a correctly rounded ``expm1(r)`` is never below ``r``, the result is exactly
    >= 0 in floating point too, where ``exp(r) - r - 1`` can round to a tiny negative number. verl also
    clamps the k3 value itself to [-10, 10]; we do not, so a drifting policy shows in the logged KL.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-max_log_ratio, max_log_ratio)  # [N, T]
    return torch.expm1(log_ratio) - log_ratio  # [N, T]


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, per token, as a loss (to minimise).

    ``loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``, ``ratio = exp(logprobs -
    old_logprobs)``. Shapes: all inputs ``[N, T]`` -> ``(loss[N, T], clipped[N, T] bool)``.

    ``clipped`` marks tokens where the clipped branch is active: the min chose the clipped term and it is
    strictly smaller than the unclipped one, so the token gets no gradient through the ratio. (A = 0 or a
    ratio inside the range is never "clipped".)

    Decisions: separate ``clip_low`` / ``clip_high`` ("clip-higher", DAPO arXiv 2503.14476, e.g. 0.2 /
    0.28); pass equal values for the symmetric PPO clip. The log-ratio is clamped before ``exp`` (see
    ``MAX_LOG_RATIO``). No dual clip (verl's ``clip_ratio_c``): with small clip ranges and fresh rollouts
    the unbounded negative-advantage branch has not been a problem; add it here if it becomes one.
    """
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(
            f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}"
        )
    log_ratio = (logprobs - old_logprobs).clamp(-max_log_ratio, max_log_ratio)  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    unclipped_objective = ratio * advantages  # [N, T]
    clipped_objective = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages  # [N, T]
    loss = -torch.minimum(unclipped_objective, clipped_objective)  # [N, T]
    clipped = clipped_objective < unclipped_objective  # [N, T] bool
    return loss, clipped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    total_weight: float | torch.Tensor,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the step loss, and summable statistics.

    ``loss = sum(token_weights * (surrogate + kl_coef * k3)) / total_weight`` (a scalar).

    Shapes: ``logprobs``, ``old_logprobs``, ``advantages``, ``token_weights``, ``ref_logprobs``: ``[N, T]``.

    - ``token_weights``: float ``[N, T]``; 0 on prompt and padding positions. Weights need not be 0/1: the
      caller uses them so each thought's tokens count once, not M times, when a thought is repeated in front
      of each of its M answers (e.g. weight 1/M on each copy, or 1 on one copy and 0 on the others).
    - ``total_weight``: the sum of ``token_weights`` over *all* micro-batches of the optimisation step
      (> 0). Then the micro-batch losses sum to the full-batch loss; backward on each and the accumulated
      gradient is the full-batch gradient. Under data parallelism that averages gradients over W ranks,
      pass the global sum divided by W.
    - ``kl_coef`` > 0 needs ``ref_logprobs``; the k3 term is added per token before weighting. When
      ``ref_logprobs`` is given, ``kl_sum`` is reported even with ``kl_coef=0`` (monitoring only).

    Returns ``(loss, stats)``; ``stats`` holds detached sums (not means) so the caller can add them over
    micro-batches (and ranks) and divide once by ``weight_sum``:
    ``clip_fraction_sum`` (weighted count of clipped tokens), ``kl_sum`` (weighted sum of k3; 0 without
    ``ref_logprobs``), ``weight_sum`` (sum of ``token_weights``).

    Decision: positions with weight 0 are replaced by 0 in every input before any arithmetic, so a -inf or
    NaN log-prob (or advantage) on a padding position cannot turn the sum into NaN (0 * inf = NaN); those
    positions get an exactly zero gradient.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logprobs (the reference policy's token log-probs)")
    if isinstance(total_weight, (int, float)) and not total_weight > 0:
        raise ValueError(
            f"total_weight (the step's summed token weights) must be > 0, got {total_weight}; "
            "skip steps with no counted tokens"
        )
    named = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    for name, tensor in named.items():
        if tensor.shape != token_weights.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but token_weights has {tuple(token_weights.shape)}; "
                "all per-token inputs must be [N, T]"
            )

    counted = token_weights != 0  # [N, T] bool

    def neutralise(tensor: torch.Tensor) -> torch.Tensor:
        return torch.where(counted, tensor, torch.zeros_like(tensor))  # [N, T]

    logprobs = neutralise(logprobs)
    surrogate, clipped = clipped_surrogate(
        logprobs,
        neutralise(old_logprobs),
        neutralise(advantages),
        clip_low=clip_low,
        clip_high=clip_high,
        max_log_ratio=max_log_ratio,
    )  # [N, T], [N, T]
    per_token = surrogate  # [N, T]
    kl = None
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, neutralise(ref_logprobs), max_log_ratio=max_log_ratio)  # [N, T]
        if kl_coef != 0:
            per_token = per_token + kl_coef * kl
    loss = (token_weights * per_token).sum() / total_weight

    with torch.no_grad():
        weight_sum = token_weights.detach().sum()
        stats = {
            "clip_fraction_sum": (token_weights.detach() * clipped.to(token_weights.dtype)).sum(),
            "kl_sum": (token_weights.detach() * kl.detach()).sum()
            if kl is not None
            else torch.zeros_like(weight_sum),
            "weight_sum": weight_sum,
        }
    return loss, stats
