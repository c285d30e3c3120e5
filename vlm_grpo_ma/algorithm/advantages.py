"""Group-relative advantages: GRPO and GRPO-MA (arXiv 2509.24494).

Pure tensor functions; nothing here knows about models, tokens or configs. Shapes:

- ``B`` prompts in the step, ``K`` thoughts per prompt, ``M`` answers per thought.
- GRPO: ``rewards[B, G]`` -> ``advantages[B, G]`` (``G`` completions per prompt).
- GRPO-MA: ``rewards[B, K, M]`` -> ``thought_adv[B, K]``, ``answer_adv[B, K, M]``.

The trainer picks an estimator by name (``algorithm.advantage_estimator``, ``ADVANTAGE_ESTIMATORS``):
``grpo_ma`` (``grpo_ma_advantages``, the default) or ``grpo`` (``flat_grpo_advantages``: plain GRPO over the
tree's K*M sequences, blind to which answers share a thought; its thought advantage is per answer, [B, K, M]).
``scale_by_std=False`` gives Dr.GRPO's advantages (arXiv 2503.20783: no division by the group's std).
``overlong_penalty`` is DAPO's soft length penalty, added to the rewards before they are normalised.

The thought advantage normalises each thought's *mean* answer reward over the K thoughts of its prompt; its
variance falls like 1/M (the point of the paper). The answer advantage normalises each answer's own reward,
over all K*M answers of the prompt ("prompt") or over the M answers of its thought ("thought"). With M = 1 and
the "prompt" baseline both reduce to plain GRPO, bit for bit (the tests pin this).

Numerics are named arguments (``eps``, ``unbiased``, ``scale_by_std``), never hidden constants. Advantages
are targets, not part of the graph: callers compute them under ``torch.no_grad()`` (nothing here needs a
gradient, but nothing prevents one either).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ANSWER_BASELINES = ("prompt", "thought")


def group_normalize(
    values: torch.Tensor,
    dim: int = -1,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> torch.Tensor:
    """Centre ``values`` on their mean along ``dim`` and, optionally, divide by their std.

    ``(values - mean) / (std + eps)`` with ``scale_by_std=True``, else ``values - mean``. Same shape as
    ``values``; each slice along ``dim`` is one group.

    Decisions:

    - ``unbiased=False`` (population std, divide by n) is the default: it is defined for every group size,
      and a group of rewards {0, 1} then gets advantages exactly +-1. verl's ``compute_grpo_outcome_
      advantage`` and TRL use ``torch.std`` (Bessel-corrected); pass ``unbiased=True`` to reproduce them.
      DeepSeekMath (arXiv 2402.03300) writes std(r) without saying which.
    - ``eps`` is added to the std (not under the square root), as in verl (``std + 1e-6``) and TRL
      (``std + 1e-4``); it only matters for near-constant groups.
    - A constant group (all values equal, detected exactly with max == min) gives exactly 0, never NaN and
      never a rounding residue such as ``0.1 - mean([0.1, 0.1, 0.1])``, even with ``eps=0``. Such a group
      carries no learning signal; it must not inject noise.
    - A group of size 1 is constant, so it gives 0. With ``unbiased=True`` its std (divide by n - 1 = 0) is
      undefined; we treat it as 0 rather than NaN, and skip ``torch.std`` so no degrees-of-freedom warning
      is raised. (verl instead passes a singleton's raw score through, as mean 0 / std 1; we do not: a
      prompt with one sample has no group to be relative to.)
    - Integer / bool input is promoted to the default float dtype; floating input is computed in its own
      dtype (pass float32 or float64 rewards, not bf16). NaN values propagate to their whole group: rewards
      are expected finite (``rewards.py`` scores a failing reward 0).
    """
    if not values.is_floating_point():
        values = values.to(torch.get_default_dtype())
    if values.shape[dim] <= 1:  # a group of 0 or 1 values: no spread, no signal (see above)
        return torch.zeros_like(values)

    mean = values.mean(dim=dim, keepdim=True)
    is_constant = values.amax(dim=dim, keepdim=True) == values.amin(dim=dim, keepdim=True)
    centred = torch.where(is_constant, torch.zeros_like(values), values - mean)
    if not scale_by_std:
        return centred
    std = values.std(dim=dim, correction=1 if unbiased else 0, keepdim=True)
    # A constant group's std may round to a tiny non-zero number, or be exactly 0 with eps=0 (0/0 = NaN):
    # divide its (already zero) centred values by 1 instead.
    denominator = torch.where(is_constant, torch.ones_like(std), std + eps)
    return centred / denominator


def grpo_advantages(
    rewards: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> torch.Tensor:
    """Plain GRPO: ``rewards[B, G]`` -> ``advantages[B, G]``, normalised over a prompt's G completions."""
    if rewards.ndim != 2:
        raise ValueError(
            "grpo_advantages expects rewards of shape [B, G] (prompts, completions), "
            f"got {tuple(rewards.shape)}"
        )
    return group_normalize(rewards, dim=-1, scale_by_std=scale_by_std, eps=eps, unbiased=unbiased)


def grpo_ma_advantages(
    rewards: torch.Tensor,
    *,
    answer_baseline: str = "prompt",
    scale_by_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO-MA advantages: ``rewards[B, K, M]`` -> ``(thought_adv[B, K], answer_adv[B, K, M])``.

    - ``thought_adv[b, k]``: ``rewards[b, k, :].mean()`` normalised over the K thoughts of prompt b.
    - ``answer_adv[b, k, m]``: ``rewards[b, k, m]`` normalised over
      ``answer_baseline="prompt"``: all K*M answers of prompt b (the paper's choice: an answer is judged
      against every answer to the same question), or
      ``answer_baseline="thought"``: the M answers of thought (b, k) (judges the answer given its thought;
      with M = 1 every group has one member, so every answer advantage is 0: answer tokens learn nothing).

    ``scale_by_std``, ``eps`` and ``unbiased`` apply to both normalisations; see ``group_normalize``
    (constant groups give exact zeros; K = 1 gives zero thought advantages).

    With M = 1 and ``answer_baseline="prompt"``:
    ``thought_adv == answer_adv[..., 0] == grpo_advantages(rewards[..., 0])`` exactly (plain GRPO).
    """
    if rewards.ndim != 3:
        raise ValueError(
            "grpo_ma_advantages expects rewards of shape [B, K, M] (prompts, thoughts per prompt, "
            f"answers per thought), got {tuple(rewards.shape)}"
        )
    if answer_baseline not in ANSWER_BASELINES:
        raise ValueError(f"answer_baseline must be one of {ANSWER_BASELINES}, got {answer_baseline!r}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    numerics = dict(scale_by_std=scale_by_std, eps=eps, unbiased=unbiased)
    batch, num_thoughts, num_answers = rewards.shape

    thought_rewards = rewards.mean(dim=-1)  # [B, K]; with M = 1 an exact copy of rewards[..., 0]
    thought_adv = group_normalize(thought_rewards, dim=-1, **numerics)  # [B, K]

    if answer_baseline == "prompt":
        per_prompt = rewards.reshape(batch, num_thoughts * num_answers)  # [B, K*M]
        answer_adv = group_normalize(per_prompt, dim=-1, **numerics).reshape(rewards.shape)  # [B, K, M]
    else:
        answer_adv = group_normalize(rewards, dim=-1, **numerics)  # [B, K, M]
    return thought_adv, answer_adv


def flat_grpo_advantages(rewards: torch.Tensor, *, answer_baseline: str = "prompt", **numerics) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain GRPO over the tree's K*M (thought, answer) sequences: ``rewards[B, K, M]`` ->
    ``(thought_adv[B, K, M], answer_adv[B, K, M])``, the tree-blind baseline GRPO-MA is compared against.

    Every sequence (thought k + answer m) is one GRPO completion, normalised over the prompt's G = K*M
    completions, and all its tokens carry that advantage: ``thought_adv[b, k, m] == answer_adv[b, k, m]``.
    The thought advantage is per *answer* (shape ``[B, K, M]``, not ``[B, K]``): a thought's tokens sit in M
    sequences and are trained in each with that sequence's advantage, as re-encoding the K*M sequences one by
    one would (``batch.build_train_batch`` reads the shape). A thought is then pushed by the sum of its M
    advantages and counts M times in the loss's normaliser; one mean advantage trained once is not the same
    objective (it is M times weaker against the answers, and under clipping not even proportional).

    ``numerics``: ``scale_by_std``, ``eps``, ``unbiased`` as in ``grpo_ma_advantages``. ``answer_baseline`` must
    be ``"prompt"`` (flat GRPO has no per-thought baseline); it is accepted so that every estimator of
    ``ADVANTAGE_ESTIMATORS`` takes the same arguments. With M = 1 its values equal ``grpo_ma_advantages(rewards,
    answer_baseline="prompt")`` exactly.
    """
    if answer_baseline != "prompt":
        raise ValueError(f"flat GRPO normalises every answer over its prompt; answer_baseline must be 'prompt', got {answer_baseline!r}")
    _, answer_adv = grpo_ma_advantages(rewards, answer_baseline="prompt", **numerics)  # [B, K, M]
    return answer_adv.clone(), answer_adv  # thought tokens of sequence (k, m) carry that sequence's advantage


def informative_prompts(rewards: torch.Tensor) -> torch.Tensor:
    """``rewards[B, K, M]`` -> ``[B]`` bool: the prompts whose K*M rewards are not all equal. A prompt whose
    rewards are all equal gets exact-zero advantages from every estimator: it carries no signal (what DAPO's
    dynamic sampling drops)."""
    flat = rewards.flatten(1)  # [B, K*M]
    return ~(flat == flat[:, :1]).all(dim=1)  # [B]


def overlong_penalty(lengths: torch.Tensor, *, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): ``lengths`` (any shape, tokens) -> reward
    shaping of the same shape, ``<= 0``.

    0 up to ``max_tokens - buffer_tokens``; then falling linearly to ``-penalty`` at ``max_tokens``; ``-penalty``
    beyond (a length can only reach ``max_tokens`` here, where the sampler stops). ``buffer_tokens = 0`` turns
    it off (all zeros). The trainer adds it to each answer's reward, once for the answer's own length against
    ``rollout.max_answer_tokens`` and once for its thought's against ``rollout.max_thought_tokens``.
    """
    if buffer_tokens < 0 or buffer_tokens > max_tokens:
        raise ValueError(f"buffer_tokens must be in [0, max_tokens={max_tokens}], got {buffer_tokens}")
    lengths = lengths.to(torch.float64)
    if buffer_tokens == 0:
        return torch.zeros_like(lengths)
    into_buffer = lengths - (max_tokens - buffer_tokens)  # > 0 inside the buffer
    return -penalty * (into_buffer / buffer_tokens).clamp(0.0, 1.0)


# Chosen by ``algorithm.advantage_estimator``. Every estimator maps rewards[B, K, M] and the same named numerics
# (answer_baseline, scale_by_std, eps, unbiased) to (thought_adv, answer_adv[B, K, M]). thought_adv is [B, K] when
# a thought is one sequence of the objective, trained once (GRPO-MA's tree), or [B, K, M] when it is trained in
# each of its M flat sequences with that sequence's advantage (flat GRPO).
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "grpo_ma": grpo_ma_advantages,
    "grpo": flat_grpo_advantages,
}


def compute_advantages(name: str, rewards: torch.Tensor, **numerics) -> tuple[torch.Tensor, torch.Tensor]:
    """The advantages of estimator ``name`` (see ``ADVANTAGE_ESTIMATORS``); an unknown name lists the known ones."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name](rewards, **numerics)
