"""TrainBatch layout: thoughts counted once, per-token advantages, and the gradient each token receives."""

import torch

from vlm_grpo_ma.batch import build_train_batch
from vlm_grpo_ma.loss import policy_loss
from vlm_grpo_ma.policy import TreeSample
from vlm_grpo_ma.rollout import Rollout


def _rollout():
    # B=1 prompt, K=2 thoughts (lengths 3 and 2, the second truncated: its last token forced), M=2 answers
    tree = TreeSample(
        thought_ids=[[11, 12, 13], [21, 22]],
        thought_logprobs=[[-1.0, -1.1, -1.2], [-2.0, 0.0]],
        thought_forced=[[False, False, False], [False, True]],
        thought_truncated=[False, True],
        thought_ended_turn=[False, False],
        answer_ids=[[31], [41, 42], [51, 52, 53], [61]],
        answer_logprobs=[[-3.0], [-4.0, -4.1], [-5.0, -5.1, -5.2], [-6.0]],
        answer_truncated=[False] * 4,
    )
    return Rollout(samples=[None], prompts=[None], num_thoughts=2, num_answers=2, tree=tree, completions=[None] * 4)


THOUGHT_ADV = torch.tensor([[0.5, -0.5]])  # [B, K]
ANSWER_ADV = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])  # [B, K, M]


def test_rows_are_thought_plus_answer_with_their_advantages():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV)
    assert batch.completion_ids == [[11, 12, 13, 31], [11, 12, 13, 41, 42], [21, 22, 51, 52, 53], [21, 22, 61]]
    assert batch.row_prompt == [0, 0, 0, 0]
    expected_adv = torch.tensor(
        [
            [0.5, 0.5, 0.5, 1.0, 0.0],
            [0.5, 0.5, 0.5, 2.0, 2.0],
            [-0.5, -0.5, 3.0, 3.0, 3.0],
            [-0.5, -0.5, 4.0, 0.0, 0.0],
        ]
    )
    assert torch.equal(batch.advantages, expected_adv)


def test_each_sampled_token_is_counted_exactly_once():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV)
    expected_weights = torch.tensor(
        [
            [1, 1, 1, 1, 0],  # thought 0 counted on its first answer's row
            [0, 0, 0, 1, 1],  # ... and not again here
            [1, 0, 1, 1, 1],  # thought 1: its forced closing token is not the policy's, weight 0
            [0, 0, 1, 0, 0],
        ],
        dtype=torch.float32,
    )
    assert torch.equal(batch.token_weights, expected_weights)
    sampled_tokens = 3 + 1 + (1 + 2 + 3 + 1)  # thought tokens once (minus the forced one) + all answer tokens
    assert batch.total_weight() == sampled_tokens


def test_gradient_carries_thought_advantage_on_thought_tokens_and_answer_advantage_on_answer_tokens():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV)
    logprobs = batch.sampling_logprobs.clone().requires_grad_(True)
    loss, _ = policy_loss(
        logprobs, logprobs.detach(), batch.advantages, batch.token_weights,
        clip_low=0.2, clip_high=0.28, total_weight=batch.total_weight(),
    )
    loss.backward()
    total = batch.total_weight()
    # at ratio 1, d loss / d logprob = -advantage * weight / total
    assert torch.allclose(logprobs.grad[0, :3], torch.full((3,), -0.5 / total), atol=1e-7, rtol=0)
    assert torch.allclose(logprobs.grad[1, :3], torch.zeros(3), atol=0, rtol=0)  # the copy counts 0
    assert torch.allclose(logprobs.grad[2, :1], torch.tensor([0.5 / total]), atol=1e-7, rtol=0)
    assert logprobs.grad[2, 1] == 0  # forced token
    assert torch.allclose(logprobs.grad[1, 3:5], torch.full((2,), -2.0 / total), atol=1e-7, rtol=0)
    assert torch.allclose(logprobs.grad[2, 2:5], torch.full((3,), -3.0 / total), atol=1e-7, rtol=0)


def test_micro_batch_slices_are_trimmed_to_their_longest_row():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV)
    tail = batch.rows(3, 4)
    assert tail.advantages.shape == (1, 3) and tail.completion_ids == [[21, 22, 61]]
    halves = [batch.rows(0, 2), batch.rows(2, 4)]
    assert sum(h.total_weight() for h in halves) == batch.total_weight()


def test_answers_after_a_thought_that_ended_the_turn_are_not_trained_on():
    rollout = _rollout()
    rollout.tree.thought_ended_turn[0] = True
    batch = build_train_batch(rollout, THOUGHT_ADV, ANSWER_ADV)
    assert batch.token_weights[0].tolist() == [1, 1, 1, 0, 0]  # the thought still gets its (negative) push
    assert batch.token_weights[1].tolist() == [0, 0, 0, 0, 0]
