"""Rollout + advantages -> TrainBatch: one row per answer (prompt + thought + answer), per-token advantages.

Each thought is shared by its M answer rows but its tokens are counted once: they carry weight 1 on the
row of answer m = 0 and weight 0 on the others. Their log-probs are identical in all M rows (same prefix),
so this gives the same gradient as weight 1/M on every row, and token-level aggregation counts every sampled
token of the tree exactly once. Forced tokens (the "</think>" closing a truncated thought) get weight 0, and
so do answers that follow a thought that ended the turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_grpo_ma.rollout import Rollout


@dataclass
class TrainBatch:
    row_prompt: list[int]  # [N] prompt index of each row
    completion_ids: list[list[int]]  # [N] thought + answer token ids
    advantages: torch.Tensor  # [N, T] per token
    token_weights: torch.Tensor  # [N, T] 0/1 (0: padding, forced, or a thought token counted on another row)
    sampling_logprobs: torch.Tensor  # [N, T] log-probs recorded while sampling
    is_thought: torch.Tensor  # [N, T] bool

    @property
    def num_rows(self) -> int:
        return len(self.completion_ids)

    def thought_lengths(self) -> list[int]:
        """Each row's number of thought tokens (its completion is thought + answer)."""
        return self.is_thought.sum(dim=1).tolist()

    def total_weight(self) -> float:
        return float(self.token_weights.sum())

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop``, columns trimmed to their longest completion (the width of their log-probs)."""
        width = max(len(ids) for ids in self.completion_ids[start:stop])
        return TrainBatch(
            self.row_prompt[start:stop],
            self.completion_ids[start:stop],
            self.advantages[start:stop, :width],
            self.token_weights[start:stop, :width],
            self.sampling_logprobs[start:stop, :width],
            self.is_thought[start:stop, :width],
        )


def build_train_batch(rollout: Rollout, thought_adv: torch.Tensor, answer_adv: torch.Tensor) -> TrainBatch:
    """thought_adv [B, K], answer_adv [B, K, M] -> TrainBatch with N = B * K * M rows."""
    tree = rollout.tree
    rows = len(tree.answer_ids)
    lengths = [len(tree.thought_ids[a // rollout.num_answers]) + len(tree.answer_ids[a]) for a in range(rows)]
    width = max(lengths)
    advantages = torch.zeros((rows, width))
    weights = torch.zeros((rows, width))
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
        advantages[a, :n_t] = float(thought_adv[b, k])
        advantages[a, n_t : n_t + n_a] = float(answer_adv[b, k, m])
        if m == 0:
            weights[a, :n_t] = torch.tensor([0.0 if forced else 1.0 for forced in tree.thought_forced[t]])
        # Answers sampled after a thought that ended the turn (EOS before "</think>") continue past the end
        # of the model's turn: they score 0 (rewards.py) and are not trained on.
        weights[a, n_t : n_t + n_a] = 0.0 if tree.thought_ended_turn[t] else 1.0
        sampling_logprobs[a, : n_t + n_a] = torch.tensor(tree.thought_logprobs[t] + tree.answer_logprobs[a])
        is_thought[a, :n_t] = True
    return TrainBatch(row_prompt, completion_ids, advantages, weights, sampling_logprobs, is_thought)
