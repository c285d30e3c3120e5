"""Rollout + advantages -> TrainBatch: one row per answer (prompt + thought + answer), per-token advantages.

Two layouts, chosen by the advantage estimator through the shape of its thought advantage:

- the tree (``thought_adv[B, K]``, GRPO-MA): each thought is shared by its M answer rows but its tokens are
  trained once, on the row of answer m = 0 (mask 0 on the others), with the thought's advantage. Their
  log-probs are identical in all M rows (same prefix), so every sampled token of the tree is trained once.
- flat (``thought_adv[B, K, M]``, GRPO): each row is one of the K*M flat sequences; the thought's tokens are
  trained on every row, with that row's advantage. The scorer computes a thought's log-probs once and hands
  them to its M rows, so this is the gradient of re-encoding the K*M sequences one by one, at no extra forward.
 Forced tokens (the "</think>" closing a truncated thought, and tool results: context the model did not
write) are not trained, and neither are answers whose reward a rule set (``Rollout.answers_void``) nor any
token of an over-turn thought (one that called a tool past ``rollout.max_turns``: Mini-o3's masking). How trained tokens are weighted in the loss is the loss
aggregation's business (``loss.aggregation_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_grpo_ma.engines.rollout import Rollout


@dataclass
class TrainBatch:
    row_prompt: list[int]  # [N] prompt index of each row
    completion_ids: list[list[int]]  # [N] thought + answer token ids
    advantages: torch.Tensor  # [N, T] per token
    token_mask: torch.Tensor  # [N, T] 1 on a trained token (0: padding, forced, a thought token counted on another row, a void answer)
    sampling_logprobs: torch.Tensor  # [N, T] log-probs recorded while sampling
    is_thought: torch.Tensor  # [N, T] bool
    flat: bool = False  # each row one sequence of the objective, its thought trained on it (see the module docstring)
    thought_turns: list | None = None  # [N] each row's thought's tool turns (model.prompts.ToolTurn), None: none
    row_staleness: list[int] | None = None  # [N] its tree's staleness (Rollout.staleness), None: fresh

    @property
    def num_rows(self) -> int:
        return len(self.completion_ids)

    def thought_lengths(self) -> list[int]:
        """Each row's number of thought tokens (its completion is thought + answer)."""
        return self.is_thought.sum(dim=1).tolist()

    def num_trained_tokens(self) -> int:
        return int(self.token_mask.sum())

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop``, columns trimmed to their longest completion (the width of their log-probs)."""
        width = max(len(ids) for ids in self.completion_ids[start:stop])
        return TrainBatch(
            self.row_prompt[start:stop],
            self.completion_ids[start:stop],
            self.advantages[start:stop, :width],
            self.token_mask[start:stop, :width],
            self.sampling_logprobs[start:stop, :width],
            self.is_thought[start:stop, :width],
            self.flat,
            None if self.thought_turns is None else self.thought_turns[start:stop],
            None if self.row_staleness is None else self.row_staleness[start:stop],
        )


def build_train_batch(
    rollout: Rollout, thought_adv: torch.Tensor, answer_adv: torch.Tensor, *, truncated_thoughts: str
) -> TrainBatch:
    """thought_adv [B, K] (tree) or [B, K, M] (flat), answer_adv [B, K, M] -> TrainBatch with N = B * K * M
    rows. ``truncated_thoughts``
    is the rollout's setting (``rollout.truncated_thoughts``): with "zero" the answers after a truncated
    thought are void (see ``Rollout.answers_void``)."""
    tree = rollout.tree
    flat = thought_adv.ndim == 3
    rows = len(tree.answer_ids)
    lengths = [len(tree.thought_ids[a // rollout.num_answers]) + len(tree.answer_ids[a]) for a in range(rows)]
    width = max(lengths)
    advantages = torch.zeros((rows, width))
    token_mask = torch.zeros((rows, width))
    sampling_logprobs = torch.zeros((rows, width))
    is_thought = torch.zeros((rows, width), dtype=torch.bool)
    row_prompt, completion_ids = [], []
    for a in range(rows):
        b, k, m = rollout.indices(a)
        t = rollout.thought_row(b, k)
        thought, answer = tree.thought_ids[t], tree.answer_ids[a]
        n_t, n_a = len(thought), len(answer)
        row_prompt.append(b)
        completion_ids.append(thought + answer)
        advantages[a, :n_t] = float(thought_adv[b, k, m] if flat else thought_adv[b, k])
        advantages[a, n_t : n_t + n_a] = float(answer_adv[b, k, m])
        if (m == 0 or flat) and not tree.thought_over_turns[t]:
            token_mask[a, :n_t] = torch.tensor([0.0 if forced else 1.0 for forced in tree.thought_forced[t]])
        token_mask[a, n_t : n_t + n_a] = 0.0 if rollout.answers_void(t, truncated_thoughts) else 1.0
        sampling_logprobs[a, : n_t + n_a] = torch.tensor(tree.thought_logprobs[t] + tree.answer_logprobs[a])
        is_thought[a, :n_t] = True
    turns = None
    if any(tree.thought_turns):
        turns = [tree.thought_turns[a // rollout.num_answers] for a in range(rows)]
    staleness = None if rollout.staleness is None else [rollout.staleness[b] for b in row_prompt]
    return TrainBatch(row_prompt, completion_ids, advantages, token_mask, sampling_logprobs, is_thought, flat, turns, staleness)
