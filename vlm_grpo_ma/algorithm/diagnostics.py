"""What GRPO-MA claims, measured every step: the thought advantage's estimation noise, groups that carry no
learning signal, and gradient spikes.

Pure functions of tensors and numbers (no config, no model), so each is tested alone on hand-made rewards.

The 1/M law. A thought's value is estimated by the mean of its M answer rewards. If one answer's reward has
variance ``s2`` around the thought's true value, the mean's variance is ``s2 / M``: the thought advantage's
estimation noise. ``thought_value_noise`` reports both, ``answer_reward_var`` (s2, the within-thought variance
of single rewards, which does not depend on M) and ``thought_value_noise_var`` (s2 / M, what the thought
advantage suffers), next to ``thought_value_spread_var``, the variance of the K thought values the advantage
compares. Across runs with different M, ``thought_value_noise_var`` falls like 1/M while
``answer_reward_var`` stays put; ``vlm_grpo_ma.study`` plots it against M with the 1/M line.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

from vlm_grpo_ma.algorithm.advantages import informative_prompts


def thought_value_noise(rewards: torch.Tensor) -> dict[str, float]:
    """rewards [B, K, M] -> the step's thought-value statistics (means over prompts and thoughts):

    - ``answer_reward_var``: the unbiased variance of a thought's M rewards (s2), averaged over thoughts;
    - ``thought_value_noise_var``: s2 / M, the sampling variance of the thought's mean reward;
    - ``thought_value_spread_var``: the unbiased variance of a prompt's K thought means, averaged over prompts.

    With M = 1 the within-thought variance cannot be estimated: the first two are NaN (K = 1: the third)."""
    num_thoughts, num_answers = rewards.shape[1], rewards.shape[2]
    values = rewards.double()
    thought_means = values.mean(dim=-1)  # [B, K]
    nan = float("nan")
    answer_var = float(values.var(dim=-1, correction=1).mean()) if num_answers > 1 else nan  # [B, K] -> mean
    spread = float(thought_means.var(dim=-1, correction=1).mean()) if num_thoughts > 1 else nan  # [B] -> mean
    return {
        "answer_reward_var": answer_var,
        "thought_value_noise_var": answer_var / num_answers,
        "thought_value_spread_var": spread,
    }


def zero_signal_shares(rewards: torch.Tensor, thought_adv: torch.Tensor, answer_adv: torch.Tensor) -> dict[str, float]:
    """The share of groups whose advantages are all zero, so that they teach nothing this step.

    rewards [B, K, M], thought_adv [B, K] (or [B, K, M], flat GRPO), answer_adv [B, K, M] ->
    ``prompt_groups`` (prompts whose K*M rewards are all equal: no advantage anywhere), ``thought_groups``
    (prompts whose K thought advantages are all 0), ``answer_groups`` (thoughts whose M answer advantages are
    all 0). Zero is exact: the advantage functions return exact zeros for constant groups."""
    constant_prompts = ~informative_prompts(rewards)  # [B]
    return {
        "prompt_groups": float(constant_prompts.double().mean()),
        "thought_groups": float((thought_adv == 0).flatten(1).all(dim=1).double().mean()),
        "answer_groups": float((answer_adv == 0).all(dim=2).double().mean()),
    }


class GradSpikeMonitor:
    """A step's grad norm against the median of the previous ``window`` steps' norms.

    ``spike ratio`` = grad norm / median of the last ``window`` norms (NaN until ``window`` norms are known).
    A step *spikes* when its ratio exceeds ``threshold``. The spike score of a run (``spike_score``) is the
    share of steps with a known ratio that spike: 0 for steady training; the paper's exact definition is not
    available here, so this one is ours and stated plainly (docs/ARCHITECTURE.md). The history is part of the
    checkpoint state, so a resumed run computes the same ratios."""

    def __init__(self, window: int = 10, threshold: float = 2.0):
        self.window, self.threshold = window, threshold
        self.history: deque[float] = deque(maxlen=window)

    def observe(self, grad_norm: float) -> float:
        """The step's spike ratio; then the norm joins the history."""
        ratio = float("nan")
        if len(self.history) == self.window:
            median = statistics.median(self.history)
            # after steps with no gradient at all (every advantage 0), any gradient is an unbounded jump
            ratio = grad_norm / median if median > 0 else (float("inf") if grad_norm > 0 else float("nan"))
        self.history.append(grad_norm)
        return ratio

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.window)


def spike_score(ratios: list[float], threshold: float = 2.0) -> float:
    """The share of known (non-NaN) spike ratios above ``threshold``; NaN when none is known."""
    known = [r for r in ratios if r == r]
    return sum(r > threshold for r in known) / len(known) if known else float("nan")
