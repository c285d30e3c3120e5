"""GRPO-MA diagnostics on hand-made rewards: the thought-value noise and its 1/M law, zero-signal groups,
gradient spikes."""

import math

import pytest
import torch

from vlm_grpo_ma.algorithm.advantages import grpo_ma_advantages
from vlm_grpo_ma.algorithm.diagnostics import (
    GradSpikeMonitor,
    spike_score,
    thought_value_noise,
    zero_signal_shares,
)


def test_thought_value_noise_hand_computed():
    # one prompt, K = 2 thoughts, M = 2 answers: thought 0 rewards (1, 0), thought 1 (1, 1)
    rewards = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])
    noise = thought_value_noise(rewards)
    assert noise["answer_reward_var"] == pytest.approx((0.5 + 0.0) / 2)  # unbiased var of (1, 0) is 0.5
    assert noise["thought_value_noise_var"] == pytest.approx(0.25 / 2)  # s2 / M
    assert noise["thought_value_spread_var"] == pytest.approx(0.125)  # var of (0.5, 1.0), unbiased


def test_thought_value_noise_falls_like_one_over_m_for_the_same_reward_distribution():
    """Bernoulli(0.3) rewards: s2 = 0.21 whatever M; the noise of the thought's mean is 0.21 / M."""
    generator = torch.Generator().manual_seed(0)
    for m in (2, 4, 8):
        rewards = (torch.rand((4000, 4, m), generator=generator) < 0.3).float()
        noise = thought_value_noise(rewards)
        assert noise["answer_reward_var"] == pytest.approx(0.21, rel=0.03)
        assert noise["thought_value_noise_var"] == pytest.approx(0.21 / m, rel=0.03)
        # the K thought values spread by exactly that noise here (every thought has the same true value)
        assert noise["thought_value_spread_var"] == pytest.approx(0.21 / m, rel=0.05)


def test_one_answer_per_thought_has_no_within_thought_variance():
    noise = thought_value_noise(torch.tensor([[[1.0], [0.0]]]))
    assert math.isnan(noise["answer_reward_var"]) and math.isnan(noise["thought_value_noise_var"])
    assert noise["thought_value_spread_var"] == pytest.approx(0.5)


def test_zero_signal_shares_hand_computed():
    rewards = torch.tensor(
        [
            [[1.0, 1.0], [1.0, 1.0]],  # constant prompt: nothing to learn
            [[1.0, 1.0], [0.0, 0.0]],  # thoughts differ; each thought's answers agree
            [[1.0, 0.0], [0.0, 1.0]],  # thought means equal (0.5, 0.5); answers differ
        ]
    )
    thought_adv, answer_adv = grpo_ma_advantages(rewards, answer_baseline="thought")
    shares = zero_signal_shares(rewards, thought_adv, answer_adv)
    assert shares["prompt_groups"] == pytest.approx(1 / 3)
    assert shares["thought_groups"] == pytest.approx(2 / 3)  # prompts 0 and 2
    assert shares["answer_groups"] == pytest.approx(4 / 6)  # both thoughts of prompts 0 and 1


def test_spike_ratio_against_the_running_median_and_the_score():
    monitor = GradSpikeMonitor(window=3, threshold=2.0)
    ratios = [monitor.observe(norm) for norm in (1.0, 2.0, 3.0, 5.0, 2.0, 1.0)]
    assert all(math.isnan(r) for r in ratios[:3])  # fewer than 3 earlier norms
    assert ratios[3:] == pytest.approx([5.0 / 2.0, 2.0 / 3.0, 1.0 / 3.0])  # medians of (1,2,3), (2,3,5), (3,5,2)
    assert spike_score(ratios) == pytest.approx(1 / 3)
    resumed = GradSpikeMonitor(window=3)
    resumed.load_state_dict(monitor.state_dict())
    assert resumed.observe(4.0) == monitor.observe(4.0)


def test_a_gradient_after_steps_without_one_is_an_unbounded_spike():
    monitor = GradSpikeMonitor(window=2)
    monitor.observe(0.0), monitor.observe(0.0)
    assert monitor.observe(1.0) == math.inf
    assert math.isnan(spike_score([float("nan")]))  # no known ratio: no score
