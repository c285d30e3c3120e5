"""The GRPO / GRPO-MA policy loss: clipped surrogate, k3 KL estimator, and how tokens are aggregated.

Pure tensor functions; numbers in, tensors out, never a config object. Shapes: ``N`` sequences (rows) in a
micro-batch, ``T`` token positions per row. Every per-token input is ``[N, T]``: log-probs of the sampled
tokens under the current policy (with grad), under the sampling policy (``old``), under the reference
policy (``ref``), the per-token advantage (already broadcast: thought tokens carry their thought's
advantage, answer tokens their answer's), and a float token weight.

The objective of one optimisation step is ``sum over trained tokens of w * (per-token policy loss + kl_coef *
k3)``. The per-token policy loss comes from ``POLICY_LOSSES`` (``algorithm.policy_loss``: PPO's clipped surrogate,
GSPO, CISPO); the weights ``w`` from ``LOSS_AGGREGATIONS`` (``algorithm.loss_aggregation``: ``token``, ``sequence``,
``dr_grpo``), normalised over the *whole step* (every micro-batch, every process).

What a "sequence" of the objective is depends on the batch's layout (``flat``), which the advantage estimator
decides (``batch.build_train_batch``):

- the tree (``flat=False``, GRPO-MA): a thought is one sequence, trained once (on the row of its first answer),
  and each answer is another; a row holds up to two sequences, its thought's and its answer's.
- flat (``flat=True``, GRPO): each row, thought + answer, is one sequence; a thought's tokens are trained on
  each of its M rows, as re-encoding the K*M sequences one by one would train them.

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
    _check_clip(clip_low, clip_high)
    log_ratio = (logprobs - old_logprobs).clamp(-max_log_ratio, max_log_ratio)  # [N, T]
    return _clipped(torch.exp(log_ratio), advantages, clip_low, clip_high)


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(
            f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}"
        )


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` and where the clipped branch won."""
    unclipped_objective = ratio * advantages  # [N, T]
    clipped_objective = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages  # [N, T]
    loss = -torch.minimum(unclipped_objective, clipped_objective)  # [N, T]
    clipped = clipped_objective < unclipped_objective  # [N, T] bool
    return loss, clipped


def segment_ids(token_mask: torch.Tensor, is_thought: torch.Tensor, *, flat: bool) -> torch.Tensor:
    """Which sequence of the objective each trained token belongs to: ``[N, T]`` long, -1 on untrained positions.

    Flat layout: row r is one sequence (id ``2r``). Tree layout: row r's thought tokens are ``2r`` and its answer
    tokens ``2r + 1`` (a thought's trained tokens all sit on one row, so ``2r`` is that thought). Ids are unique
    within the rows passed, which is all a per-sequence quantity (GSPO's ratio) needs."""
    rows = torch.arange(token_mask.shape[0], device=token_mask.device)[:, None] * 2  # [N, 1]
    ids = rows + (torch.zeros_like(is_thought, dtype=torch.long) if flat else (~is_thought).long())  # [N, T]
    return torch.where(token_mask != 0, ids, torch.full_like(ids, -1))  # [N, T]


def _sequence_mean(values: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Each position's sequence mean of ``values`` over the positions of its sequence (``segments`` >= 0); 0
    elsewhere. Shapes: [N, T], [N, T] -> [N, T]."""
    counted = segments >= 0  # [N, T]
    flat_ids = segments[counted]  # [n]
    _, inverse = torch.unique(flat_ids, return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, inverse, values[counted])
    counts = torch.zeros_like(sums).index_add(0, inverse, torch.ones_like(values[counted]))
    means = torch.zeros_like(values)
    means[counted] = (sums / counts)[inverse]
    return means  # [N, T]


def gspo_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    segments: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (arXiv 2507.18071), token form: the importance ratio is the sequence's, length-normalised,
    ``s = exp(mean over the sequence of (logprobs - old_logprobs))``, and each token uses
    ``s_t = sg(s) * pi(y_t) / sg(pi(y_t))`` (value ``s``, gradient ``s * grad log pi(y_t)``) in PPO's clipped
    surrogate. Shapes: ``[N, T]`` each (``segments`` from ``segment_ids``) -> ``(loss[N, T], clipped[N, T])``.

    A sequence is clipped or not as a whole. On GRPO-MA's tree a thought's ratio is over the thought's tokens and
    an answer's over its own; flat, over the whole row. GSPO's paper clips at 3e-4 / 4e-4 (set
    ``clip_low``/``clip_high``): sequence ratios stay much closer to 1 than token ratios."""
    _check_clip(clip_low, clip_high)
    log_ratio = (logprobs - old_logprobs).clamp(-max_log_ratio, max_log_ratio)  # [N, T]
    sequence_log_ratio = _sequence_mean(log_ratio.detach(), segments)  # [N, T], constant along a sequence
    ratio = torch.exp(sequence_log_ratio + logprobs - logprobs.detach())  # [N, T]: value s, gradient s * dlogpi
    return _clipped(ratio, advantages, clip_low, clip_high)


def cispo_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    segments: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``loss = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A *
    logprobs``. Shapes: ``[N, T]`` -> ``(loss[N, T], clipped[N, T])``; ``segments`` is unused.

    Unlike PPO's clip, no token loses its gradient: the importance weight is clipped (and not differentiated),
    the log-prob keeps its push. ``clipped`` marks tokens whose weight was clipped. MiniMax-M1 leaves the lower
    side open: ``clip_low=1`` does that. At ratio 1 its gradient is PPO's (``-A * grad log pi``); its value is
    ``-A * logprobs``, not ``-A``."""
    _check_clip(clip_low, clip_high)
    log_ratio = (logprobs - old_logprobs).clamp(-max_log_ratio, max_log_ratio).detach()  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    clipped = weight != ratio  # [N, T] bool
    return -weight * advantages * logprobs, clipped


def ppo_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    segments: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped surrogate (``clipped_surrogate``) in the registry's signature; ``segments`` unused."""
    return clipped_surrogate(logprobs, old_logprobs, advantages, clip_low=clip_low, clip_high=clip_high, max_log_ratio=max_log_ratio)


# Chosen by ``algorithm.policy_loss``. Each maps (logprobs, old_logprobs, advantages, segments) [N, T] and the clip
# range to (per-token loss [N, T], clipped [N, T] bool). verl calls ``ppo`` "vanilla".
def truncated_importance_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, *, cap: float, max_log_ratio: float = MAX_LOG_RATIO
) -> torch.Tensor:
    """Truncated importance sampling (TIS, as verl's rollout correction): ``min(exp(old - engine), cap)`` per
    token, no gradient. ``old_logprobs`` are the trainer's log-probs of the sampling policy
    (``update.score_rows``), ``engine_logprobs`` those the sampling engine reported for the same tokens; where
    they agree the weight is 1. The tokens were drawn from the engine's distribution, the loss assumes the
    trainer's: the weight re-weights each token towards the trainer's, capped so that a token the engine found
    far less likely cannot dominate. Shapes: [N, T], [N, T] -> [N, T]."""
    if not cap >= 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    log_ratio = (old_logprobs.detach() - engine_logprobs.detach()).clamp(-max_log_ratio, max_log_ratio)  # [N, T]
    return log_ratio.exp().clamp(max=cap)  # [N, T]


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "ppo": ppo_surrogate,
    "gspo": gspo_surrogate,
    "cispo": cispo_surrogate,
}


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
    surrogate: str = "ppo",
    segments: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the step loss, and summable statistics.

    ``loss = sum(token_weights * (surrogate + kl_coef * k3)) / total_weight`` (a scalar), with the per-token
    ``surrogate`` of ``POLICY_LOSSES`` (an unknown name lists the known ones). ``segments`` [N, T]
    (``segment_ids``) says which sequence each token belongs to; only GSPO reads it (default: one sequence
    per row).

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
    - ``importance_weights`` [N, T] (no gradient; ``truncated_importance_weights``): multiply each token's
      surrogate (not its KL term), correcting for a sampling engine whose log-probs differ from the trainer's.

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
    if surrogate not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {surrogate!r}; known: {', '.join(POLICY_LOSSES)}")
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
    if segments is None:
        segments = segment_ids(token_weights, torch.zeros_like(counted), flat=True)
    per_token, clipped = POLICY_LOSSES[surrogate](
        logprobs,
        neutralise(old_logprobs),
        neutralise(advantages),
        segments,
        clip_low=clip_low,
        clip_high=clip_high,
        max_log_ratio=max_log_ratio,
    )  # [N, T], [N, T]
    if importance_weights is not None:
        if importance_weights.shape != token_weights.shape:
            raise ValueError(
                f"importance_weights has shape {tuple(importance_weights.shape)} but token_weights has"
                f" {tuple(token_weights.shape)}; all per-token inputs must be [N, T]"
            )
        per_token = per_token * neutralise(importance_weights.detach())
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
# Every aggregation takes ``token_mask`` [N, T] (1 on a trained token) and ``is_thought`` [N, T] (bool), the
# layout ``flat`` (see the module docstring), and the step's totals over all micro-batches and processes:
# ``num_tokens`` (trained tokens), ``num_thoughts`` (B * K), ``num_answers`` (B * K * M: also the number of flat
# sequences), and the sampling limits ``max_thought_tokens``, ``max_answer_tokens``. It returns weights [N, T]
# whose sum over the whole step is 1 (less when some sequences have no trained token: void answers).
#
# On the tree a step's objective has two halves, the thoughts' and the answers'. GRPO-MA's paper sums them;
# we average them (a constant factor 1/2 on the gradient), so that every aggregation puts a total weight of 1
# on the step and a learning rate means the same under each.


def _per_sequence(mask: torch.Tensor, is_thought: torch.Tensor, flat: bool, thought_size, answer_size, num_thoughts: int, num_answers: int) -> torch.Tensor:
    """Weights that give each sequence of the objective an equal share of the step, spread over its tokens
    as ``mask / size``. ``thought_size`` / ``answer_size``: [N, 1] tensors or numbers, the divisor of a
    thought's / an answer's tokens (flat: ``answer_size`` is the whole row's)."""
    if num_thoughts <= 0 or num_answers <= 0:
        raise ValueError(f"num_thoughts and num_answers must be > 0, got {num_thoughts} and {num_answers}")
    if flat:
        return mask / (answer_size * num_answers)  # [N, T]
    thought_mask = mask * is_thought  # [N, T]
    answer_mask = mask * ~is_thought  # [N, T]
    return 0.5 * (thought_mask / (thought_size * num_thoughts) + answer_mask / (answer_size * num_answers))  # [N, T]


def token_mean_weights(
    token_mask: torch.Tensor, is_thought: torch.Tensor, *, flat: bool, num_tokens: float, num_thoughts: int,
    num_answers: int, max_thought_tokens: int, max_answer_tokens: int,
) -> torch.Tensor:  # fmt: skip
    """``token`` (DAPO's token-level loss): every trained token of the step weighs ``1 / num_tokens``. Flat, a
    thought's tokens are trained on M rows and count M times, as in the K*M sequences they stand for.
    Shapes: [N, T] -> [N, T]."""
    if not num_tokens > 0:
        raise ValueError(f"num_tokens (trained tokens in the step) must be > 0, got {num_tokens}")
    return token_mask.to(torch.float64) / num_tokens  # [N, T]


def sequence_mean_weights(
    token_mask: torch.Tensor, is_thought: torch.Tensor, *, flat: bool, num_tokens: float, num_thoughts: int,
    num_answers: int, max_thought_tokens: int, max_answer_tokens: int,
) -> torch.Tensor:  # fmt: skip
    """``sequence`` (GRPO as published, DeepSeekMath: ``1/G sum_i 1/|o_i| sum_t``, averaged over prompts).

    Flat: a token of row r weighs ``1 / (|o_r| * num_answers)``, ``|o_r|`` the row's trained tokens (thought +
    answer): exactly DeepSeekMath over the K*M sequences. Tree: a thought token weighs
    ``1 / (2 * |thought| * num_thoughts)``, an answer token ``1 / (2 * |answer| * num_answers)``: the thoughts'
    half and the answers' half of GRPO-MA's objective, each a per-sequence mean. Shapes: [N, T] -> [N, T].

    A sequence with no trained token (an answer after a thought that ended the turn) still counts in
    ``num_thoughts`` / ``num_answers``: it is a member of its group whose loss is 0."""
    mask = token_mask.to(torch.float64)  # [N, T]
    if flat:
        row_tokens = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [N, 1]
        return _per_sequence(mask, is_thought, True, None, row_tokens, num_thoughts, num_answers)
    thought_tokens = (mask * is_thought).sum(dim=1, keepdim=True).clamp(min=1.0)  # [N, 1]
    answer_tokens = (mask * ~is_thought).sum(dim=1, keepdim=True).clamp(min=1.0)  # [N, 1]
    return _per_sequence(mask, is_thought, False, thought_tokens, answer_tokens, num_thoughts, num_answers)


def dr_grpo_weights(
    token_mask: torch.Tensor, is_thought: torch.Tensor, *, flat: bool, num_tokens: float, num_thoughts: int,
    num_answers: int, max_thought_tokens: int, max_answer_tokens: int,
) -> torch.Tensor:  # fmt: skip
    """``dr_grpo`` (Dr.GRPO, arXiv 2503.20783): ``sequence`` with each sequence's length replaced by a constant,
    the longest it could be, so a sequence's weight no longer grows as it shortens (the length bias Dr.GRPO
    removes). Flat: ``1 / ((max_thought_tokens + max_answer_tokens) * num_answers)``; tree: a thought token
    ``1 / (2 * max_thought_tokens * num_thoughts)``, an answer token ``1 / (2 * max_answer_tokens * num_answers)``.
    The step's weights sum to at most 1 (1 only when every sequence is as long as it can be). Pair with
    ``algorithm.scale_by_std=false`` for Dr.GRPO's advantages. Shapes: [N, T] -> [N, T]."""
    if max_thought_tokens <= 0 or max_answer_tokens <= 0:
        raise ValueError(f"max_thought_tokens and max_answer_tokens must be > 0, got {max_thought_tokens} and {max_answer_tokens}")
    mask = token_mask.to(torch.float64)  # [N, T]
    if flat:
        return _per_sequence(mask, is_thought, True, None, max_thought_tokens + max_answer_tokens, num_thoughts, num_answers)
    return _per_sequence(mask, is_thought, False, max_thought_tokens, max_answer_tokens, num_thoughts, num_answers)


LOSS_AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token": token_mean_weights,
    "sequence": sequence_mean_weights,
    "dr_grpo": dr_grpo_weights,
}


def aggregation_weights(name: str, token_mask: torch.Tensor, is_thought: torch.Tensor, **totals) -> torch.Tensor:
    """The weights of loss aggregation ``name`` (see ``LOSS_AGGREGATIONS``); an unknown name lists the known ones."""
    if name not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {name!r}; known: {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[name](token_mask, is_thought, **totals)
