"""Shared by the model tests: compare tree-sampled log-probs with a full re-encode of each row."""

import torch

from vlm_grpo_ma.model.logprobs import sequence_logprobs


def branched_vs_reencoded(policy, prompts, tree, num_thoughts, num_answers) -> tuple[float, int]:
    """Max |sampling log-prob - re-encoded log-prob| over every non-forced token of prompt + thought + answer
    rows, and the number of tokens compared."""
    rows, completions = [], []
    for a, answer in enumerate(tree.answer_ids):
        t = a // num_answers
        rows.append(t // num_thoughts)
        completions.append(tree.thought_ids[t] + answer)
    with torch.no_grad():
        full = sequence_logprobs(policy, prompts, rows, completions, temperature=1.0)
    worst, compared = 0.0, 0
    for a, answer in enumerate(tree.answer_ids):
        t = a // num_answers
        sampled = tree.thought_logprobs[t] + tree.answer_logprobs[a]
        forced = tree.thought_forced[t] + [False] * len(answer)
        for j, value in enumerate(sampled):
            if not forced[j]:
                worst = max(worst, abs(value - float(full[a, j])))
                compared += 1
    return worst, compared
