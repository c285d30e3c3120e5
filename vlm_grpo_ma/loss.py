"""The GRPO / GRPO-MA policy loss: clipped surrogate, k3 KL estimator, and how tokens are aggregated.

Pure tensor functions; numbers in, tensors out, never a config object. Shapes: ``N`` sequences (rows) in a
micro-batch, ``T`` token positions per row. Every per-token input is ``[N, T]``: log-probs of the sampled
tokens under the current policy (with grad), under the sampling policy (``old``), under the reference
policy (``ref``), the per-token advantage (already broadcast: thought tokens carry their thought's
advantage, answer tokens their answer's), and a float token weight.

The objective of one optimisation step is ``sum over trained tokens of w * (surrogate + kl_coef * k3)``, where
the per-token weights ``w`` come from a loss aggregation (``LOSS_AGGREGATIONS``, chosen by
``algorithm.loss_aggregation``) and are normalised over the *whole step* (every micro-batch, every process):

- ``token``: one mean over every trained token of the step (DAPO, arXiv 2503.14476, "token-level policy
  gradient loss"). A token's weight does not depend on its sequence's length; thought and answer tokens share
  one mean, so the thoughts' share of the gradient is their share of the tokens, which falls as M grows.
- ``sequence``: GRPO as published (DeepSeekMath): each sequence's tokens are averaged over that sequence, then
  sequences are averaged. In GRPO-MA the thoughts and the answers are two kinds of sequence: each thought's
  tokens are averaged over the thought and the K thoughts of the step averaged; each answer's tokens over the
  answer and the K*M answers averaged; the two parts are summed. Thoughts then get half the gradient mass
  whatever M is.

Because the weights are normalised over the step, micro-batch losses add up to the full-batch loss exactly and
gradient accumulation is the same computation as one big batch.
"""

from __future__ import annotations

from collections.abc import Callable

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

    - ``token_weights``: float ``[N, T]``; 0 on prompt and padding positions and on a thought's copies
      after the first (a thought repeated in front of each of its M answers counts once). The trainer passes
      ``aggregation_weights(...)``, already normalised over the whole step.
    - ``total_weight``: what the weighted sum is divided by (> 0): 1 for weights already normalised over the
      step; for 0/1 weights, their sum over *all* micro-batches of the step (a token mean). Either way the
      micro-batch losses sum to the full-batch loss, and backward on each accumulates the full-batch gradient.
      Under data parallelism that averages gradients over W ranks, pass the value divided by W.
    - ``kl_coef`` > 0 needs ``ref_logprobs``; the k3 term is added per token before weighting. When
      ``ref_logprobs`` is given, ``kl_sum`` is reported even with ``kl_coef=0`` (monitoring only).

    Returns ``(loss, stats)``; ``stats`` holds detached weighted sums (not means) so the caller can add them
    over micro-batches (and ranks) and divide once by ``weight_sum``:
    ``clip_fraction_sum`` (clipped tokens), ``kl_sum`` (k3; 0 without ``ref_logprobs``), ``nll_sum``
    (-logprobs: how likely the current policy finds the sampled tokens), ``pg_loss_sum`` (``-A * logprobs``:
    the policy-gradient loss in REINFORCE form. With one update per rollout the ratio is 1, so the surrogate's
    value is ``-A`` whatever the model, while this one depends on it and has the same gradient),
    ``log_ratio_abs_max`` (max |logprobs - old_logprobs| over trained tokens: 0 at the first update of a step
    when old and new log-probs come from one computation) and ``weight_sum`` (sum of ``token_weights``).

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
            f"total_weight (the step loss's normaliser) must be > 0, got {total_weight}; "
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
        weights = token_weights.detach()
        weight_sum = weights.sum()
        new = logprobs.detach()
        stats = {
            "clip_fraction_sum": (weights * clipped.to(weights.dtype)).sum(),
            "kl_sum": (weights * kl.detach()).sum() if kl is not None else torch.zeros_like(weight_sum),
            "nll_sum": -(weights * new).sum(),
            "pg_loss_sum": -(weights * neutralise(advantages) * new).sum(),
            "log_ratio_abs_max": (new - neutralise(old_logprobs)).abs().max() if new.numel() else torch.zeros(()),
            "weight_sum": weight_sum,
        }
    return loss, stats


# ----------------------------------------------------------------------------------------------------------
# Loss aggregations: per-token weights of one micro-batch, normalised over the whole step.
#
# Every aggregation takes ``token_mask`` [N, T] (1 on a trained token: a sampled token counted on this row;
# a thought's tokens are counted on one of its M rows only) and ``is_thought`` [N, T] (bool), plus the step's
# totals over all micro-batches and processes: ``num_tokens`` (trained tokens), ``num_thoughts`` (B * K) and
# ``num_answers`` (B * K * M). It returns weights [N, T] that sum, over the whole step, to the number of parts
# of the objective (1 for ``token``; at most 2 for ``sequence``, thought part + answer part).


def token_mean_weights(
    token_mask: torch.Tensor, is_thought: torch.Tensor, *, num_tokens: float, num_thoughts: int, num_answers: int
) -> torch.Tensor:
    """``token``: every trained token of the step weighs ``1 / num_tokens``. Shapes: [N, T] -> [N, T]."""
    if not num_tokens > 0:
        raise ValueError(f"num_tokens (trained tokens in the step) must be > 0, got {num_tokens}")
    return token_mask.to(torch.float64) / num_tokens  # [N, T]


def sequence_mean_weights(
    token_mask: torch.Tensor, is_thought: torch.Tensor, *, num_tokens: float, num_thoughts: int, num_answers: int
) -> torch.Tensor:
    """``sequence``: a thought token weighs ``1 / (its thought's trained tokens * num_thoughts)``, an answer
    token ``1 / (its answer's trained tokens * num_answers)``. Shapes: [N, T] -> [N, T].

    A thought's trained tokens all sit on one row (the caller counts a thought once), so a row's thought
    tokens are that thought's. A sequence with no trained token (an answer after a thought that ended the
    turn) still counts in ``num_thoughts`` / ``num_answers``: it is a member of its group whose loss is 0."""
    if num_thoughts <= 0 or num_answers <= 0:
        raise ValueError(f"num_thoughts and num_answers must be > 0, got {num_thoughts} and {num_answers}")
    mask = token_mask.to(torch.float64)  # [N, T]
    thought_mask = mask * is_thought  # [N, T]
    answer_mask = mask * ~is_thought  # [N, T]
    thought_tokens = thought_mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [N, 1]
    answer_tokens = answer_mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [N, 1]
    return thought_mask / (thought_tokens * num_thoughts) + answer_mask / (answer_tokens * num_answers)  # [N, T]


LOSS_AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token": token_mean_weights,
    "sequence": sequence_mean_weights,
}


def aggregation_weights(name: str, token_mask: torch.Tensor, is_thought: torch.Tensor, **totals) -> torch.Tensor:
    """The weights of loss aggregation ``name`` (see ``LOSS_AGGREGATIONS``); an unknown name lists the known ones."""
    if name not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {name!r}; known: {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[name](token_mask, is_thought, **totals)
