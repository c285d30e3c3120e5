"""TrainBatch layout: thoughts counted once, per-token advantages, and the gradient each token receives."""

import pytest
import torch

from vlm_grpo_ma.algorithm.loss import LOSS_AGGREGATIONS, aggregation_weights, policy_loss
from vlm_grpo_ma.engines.decode import TreeSample
from vlm_grpo_ma.engines.rollout import Rollout
from vlm_grpo_ma.run.batch import build_train_batch


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
# answers of 1, 2, 3 and 1 tokens. B = 1, K = 2, M = 2. Sampling limits: 3 thought and 3 answer tokens.
LIMITS = dict(max_thought_tokens=3, max_answer_tokens=3)
TOTALS = dict(num_tokens=11, num_thoughts=2, num_answers=4, **LIMITS)
# The flat layout (GRPO): rows of 4, 5, 4 and 2 trained tokens (each thought counted on both its rows).
FLAT_TOTALS = dict(TOTALS, num_tokens=15)
FLAT_THOUGHT_ADV = ANSWER_ADV.clone()  # flat GRPO: the thought's tokens carry their sequence's advantage


def _gradient(aggregation: str, *, flat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss / d logprobs at ratio 1 under ``aggregation``, with every advantage 1 (so it is -weight)."""
    batch = build_train_batch(_rollout(), FLAT_THOUGHT_ADV if flat else THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    totals = FLAT_TOTALS if flat else TOTALS
    weights = aggregation_weights(aggregation, batch.token_mask, batch.is_thought, flat=batch.flat, **totals)
    logprobs = batch.sampling_logprobs.double().requires_grad_(True)
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.ones_like(logprobs), weights, clip_low=0.2, clip_high=0.28, total_weight=1.0)
    loss.backward()
    return -logprobs.grad, batch.is_thought


def test_token_aggregation_gives_every_trained_token_the_same_weight():
    mass, is_thought = _gradient("token")
    expected = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close").token_mask.double() / 11
    assert torch.allclose(mass, expected, atol=1e-15, rtol=0)
    assert float(mass[is_thought].sum()) == pytest.approx(4 / 11, abs=1e-15)  # thoughts: their share of the tokens
    assert float(mass[~is_thought].sum()) == pytest.approx(7 / 11, abs=1e-15)


def test_sequence_aggregation_averages_each_thought_and_each_answer_then_the_two_halves():
    mass, is_thought = _gradient("sequence")
    expected = torch.tensor(
        [
            [1 / 12, 1 / 12, 1 / 12, 1 / 8, 0],  # thought 0: 3 tokens, 1 of 2 thoughts, half; answer [31]: 1 of 4 answers, half
            [0, 0, 0, 1 / 16, 1 / 16],  # answer [41, 42]: 2 tokens
            [1 / 4, 0, 1 / 24, 1 / 24, 1 / 24],  # thought 1: 1 trained token (the forced one is not)
            [0, 0, 1 / 8, 0, 0],
        ],
        dtype=torch.float64,
    )
    assert torch.allclose(mass, expected, atol=1e-15, rtol=0)
    assert float(mass[is_thought].sum()) == pytest.approx(0.5, abs=1e-15)  # half the mass, whatever M is
    assert float(mass.sum()) == pytest.approx(1.0, abs=1e-15)  # the step weighs 1, as under token


def test_dr_grpo_aggregation_divides_by_the_longest_possible_sequence():
    mass, _ = _gradient("dr_grpo")
    thought, answer = 1 / (2 * 3 * 2), 1 / (2 * 3 * 4)  # half / (max tokens * sequences of the kind)
    expected = torch.tensor(
        [
            [thought, thought, thought, answer, 0],
            [0, 0, 0, answer, answer],
            [thought, 0, answer, answer, answer],
            [0, 0, answer, 0, 0],
        ],
        dtype=torch.float64,
    )
    assert torch.allclose(mass, expected, atol=1e-15, rtol=0)


def test_flat_layout_trains_each_thought_on_every_row_with_that_rows_advantage():
    batch = build_train_batch(_rollout(), FLAT_THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    assert batch.flat
    assert batch.token_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [1, 0, 1, 0, 0]]
    assert batch.advantages.tolist() == [[1, 1, 1, 1, 0], [2, 2, 2, 2, 2], [3, 3, 3, 3, 3], [4, 4, 4, 0, 0]]
    assert batch.num_trained_tokens() == 15
    assert batch.rows(1, 3).flat  # micro-batches keep the layout


def test_flat_aggregations_are_deepseekmath_dapo_and_dr_grpo_over_the_k_times_m_sequences():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [1, 0, 1, 0, 0]], dtype=torch.float64)
    token, _ = _gradient("token", flat=True)
    assert torch.allclose(token, mask / 15, atol=1e-15, rtol=0)
    sequence, _ = _gradient("sequence", flat=True)  # 1 / (G * |o|): rows of 4, 5, 4 and 2 trained tokens
    per_row = torch.tensor([[1 / 16], [1 / 20], [1 / 16], [1 / 8]], dtype=torch.float64)
    assert torch.allclose(sequence, mask * per_row, atol=1e-15, rtol=0)
    assert float(sequence.sum()) == pytest.approx(1.0, abs=1e-15)
    dr_grpo, _ = _gradient("dr_grpo", flat=True)  # 1 / (G * (max thought + max answer tokens))
    assert torch.allclose(dr_grpo, mask / (4 * 6), atol=1e-15, rtol=0)


@pytest.mark.parametrize("flat", [False, True])
def test_aggregation_weights_of_micro_batches_are_those_of_the_whole_batch(flat):
    batch = build_train_batch(_rollout(), FLAT_THOUGHT_ADV if flat else THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    totals = FLAT_TOTALS if flat else TOTALS
    for name in LOSS_AGGREGATIONS:
        whole = aggregation_weights(name, batch.token_mask, batch.is_thought, flat=flat, **totals)
        parts = [batch.rows(0, 1), batch.rows(1, 3), batch.rows(3, 4)]
        for start, part in zip((0, 1, 3), parts, strict=True):
            split = aggregation_weights(name, part.token_mask, part.is_thought, flat=flat, **totals)
            width = split.shape[1]
            assert torch.equal(split, whole[start : start + part.num_rows, :width]), name


def test_unknown_aggregation_names_the_known_ones():
    batch = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq'; known: token, sequence, dr_grpo"):
        aggregation_weights("seq", batch.token_mask, batch.is_thought, flat=False, **TOTALS)


def test_config_choices_are_the_registered_aggregations():
    from vlm_grpo_ma.run.config import CHOICES

    assert CHOICES["algorithm.loss_aggregation"] == tuple(LOSS_AGGREGATIONS)


def test_zero_truncated_thoughts_keep_their_thought_tokens_but_not_their_answers():
    """rollout.truncated_thoughts=zero: thought 1 was truncated, its answers scored 0 by rule; the thought's
    tokens carry that penalty, its answers' tokens are not trained (their reward says nothing about them)."""
    close = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="close")
    zero = build_train_batch(_rollout(), THOUGHT_ADV, ANSWER_ADV, truncated_thoughts="zero")
    assert torch.equal(zero.token_mask[:2], close.token_mask[:2])  # thought 0 was not truncated
    assert zero.token_mask[2].tolist() == [1, 0, 0, 0, 0]  # thought 1's sampled token only
    assert zero.token_mask[3].tolist() == [0, 0, 0, 0, 0]
