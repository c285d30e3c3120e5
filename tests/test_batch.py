"""TrainBatch layout: thoughts counted once, per-token advantages, and the gradient each token receives."""

import pytest
import torch

from vlm_grpo_ma.batch import build_train_batch
from vlm_grpo_ma.loss import LOSS_AGGREGATIONS, aggregation_weights, policy_loss
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
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
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
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    expected_weights = torch.tensor(
        [
            [1, 1, 1, 1, 0],  # thought 0 counted on its first answer's row
            [0, 0, 0, 1, 1],  # ... and not again here
            [1, 0, 1, 1, 1],  # thought 1: its forced closing token is not the policy's, weight 0
            [0, 0, 1, 0, 0],
        ],
        dtype=torch.float32,
    )
    assert torch.equal(batch.token_mask, expected_weights)
    sampled_tokens = 3 + 1 + (1 + 2 + 3 + 1)  # thought tokens once (minus the forced one) + all answer tokens
    assert batch.num_trained_tokens() == sampled_tokens


def test_gradient_carries_thought_advantage_on_thought_tokens_and_answer_advantage_on_answer_tokens():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    logprobs = batch.sampling_logprobs.clone().requires_grad_(True)
    loss, _ = policy_loss(
        logprobs, logprobs.detach(), batch.advantages, batch.token_mask,
        clip_low=0.2, clip_high=0.28, total_weight=batch.num_trained_tokens(),
    )
    loss.backward()
    total = batch.num_trained_tokens()
    # at ratio 1, d loss / d logprob = -advantage * weight / total
    assert torch.allclose(logprobs.grad[0, :3], torch.full((3,), -0.5 / total), atol=1e-7, rtol=0)
    assert torch.allclose(logprobs.grad[1, :3], torch.zeros(3), atol=0, rtol=0)  # the copy counts 0
    assert torch.allclose(logprobs.grad[2, :1], torch.tensor([0.5 / total]), atol=1e-7, rtol=0)
    assert logprobs.grad[2, 1] == 0  # forced token
    assert torch.allclose(logprobs.grad[1, 3:5], torch.full((2,), -2.0 / total), atol=1e-7, rtol=0)
    assert torch.allclose(logprobs.grad[2, 2:5], torch.full((3,), -3.0 / total), atol=1e-7, rtol=0)


def test_micro_batch_slices_are_trimmed_to_their_longest_row():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    tail = batch.rows(3, 4)
    assert tail.advantages.shape == (1, 3) and tail.completion_ids == [[21, 22, 61]]
    halves = [batch.rows(0, 2), batch.rows(2, 4)]
    assert sum(h.num_trained_tokens() for h in halves) == batch.num_trained_tokens()


def test_answers_after_a_thought_that_ended_the_turn_are_not_trained_on():
    rollout = _rollout()
    rollout.tree.thought_ended_turn[0] = True
    batch = build_train_batch(rollout, THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    assert batch.token_mask[0].tolist() == [1, 1, 1, 0, 0]  # the thought still gets its (negative) push
    assert batch.token_mask[1].tolist() == [0, 0, 0, 0, 0]


# ----------------------------------------------------------------------------------------------------------
# Loss aggregation on the same tree: trained tokens are thought 0 (3), thought 1 (1: its last token is forced),
# answers of 1, 2, 3 and 1 tokens. B = 1, K = 2, M = 2.
TOTALS = dict(num_tokens=11, num_thoughts=2, num_answers=4)


def _gradient(aggregation: str, advantages_one: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss / d logprobs at ratio 1 under ``aggregation``, with every advantage 1 (so it is -weight)."""
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    weights = aggregation_weights(aggregation, batch.token_mask, batch.is_thought, **TOTALS)
    logprobs = batch.sampling_logprobs.double().requires_grad_(True)
    advantages = torch.ones_like(logprobs) if advantages_one else batch.advantages.double()
    loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, weights, clip_low=0.2, clip_high=0.28, total_weight=1.0)
    loss.backward()
    return -logprobs.grad, batch.is_thought


def test_token_aggregation_gives_every_trained_token_the_same_weight():
    mass, is_thought = _gradient("token")
    expected = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close").token_mask.double() / 11
    assert torch.allclose(mass, expected, atol=1e-15, rtol=0)
    assert float(mass[is_thought].sum()) == pytest.approx(4 / 11, abs=1e-15)  # thoughts: their share of the tokens
    assert float(mass[~is_thought].sum()) == pytest.approx(7 / 11, abs=1e-15)


def test_sequence_aggregation_averages_each_thought_and_each_answer_then_sums_the_two_parts():
    mass, is_thought = _gradient("sequence")
    expected = torch.tensor(
        [
            [1 / 6, 1 / 6, 1 / 6, 1 / 4, 0],  # thought 0: 3 tokens, 1 of 2 thoughts; answer [31]: 1 of 4 answers
            [0, 0, 0, 1 / 8, 1 / 8],  # answer [41, 42]: 2 tokens
            [1 / 2, 0, 1 / 12, 1 / 12, 1 / 12],  # thought 1: 1 trained token (the forced one is not)
            [0, 0, 1 / 4, 0, 0],
        ],
        dtype=torch.float64,
    )
    assert torch.allclose(mass, expected, atol=1e-15, rtol=0)
    assert float(mass[is_thought].sum()) == pytest.approx(1.0, abs=1e-15)  # half the mass, whatever M is
    assert float(mass[~is_thought].sum()) == pytest.approx(1.0, abs=1e-15)


def test_aggregation_weights_of_micro_batches_are_those_of_the_whole_batch():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    for name in LOSS_AGGREGATIONS:
        whole = aggregation_weights(name, batch.token_mask, batch.is_thought, **TOTALS)
        parts = [batch.rows(0, 1), batch.rows(1, 3), batch.rows(3, 4)]
        for start, part in zip((0, 1, 3), parts, strict=True):
            split = aggregation_weights(name, part.token_mask, part.is_thought, **TOTALS)
            width = split.shape[1]
            assert torch.equal(split, whole[start : start + part.num_rows, :width]), name


def test_unknown_aggregation_names_the_known_ones():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq'; known: token, sequence"):
        aggregation_weights("seq", batch.token_mask, batch.is_thought, **TOTALS)


def test_config_choices_are_the_registered_aggregations():
    from vlm_grpo_ma.config import CHOICES

    assert CHOICES["algorithm.loss_aggregation"] == tuple(LOSS_AGGREGATIONS)


def test_zero_truncated_thoughts_keep_their_thought_tokens_but_not_their_answers():
    """rollout.truncated_thoughts=zero: thought 1 was truncated, its answers scored 0 by rule; the thought's
    tokens carry that penalty, its answers' tokens are not trained (their reward says nothing about them)."""
    close = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    zero = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="zero")
    assert torch.equal(zero.token_mask[:2], close.token_mask[:2])  # thought 0 was not truncated
    assert zero.token_mask[2].tolist() == [1, 0, 0, 0, 0]  # thought 1's sampled token only
    assert zero.token_mask[3].tolist() == [0, 0, 0, 0, 0]
