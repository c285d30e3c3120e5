"""The resampled variance of thought values and thought advantages (``vlm_grpo_ma.variance``)."""

import json

import pytest
import torch

from vlm_grpo_ma.algorithm.advantages import grpo_ma_advantages
from vlm_grpo_ma.tools import variance

NUMERICS = dict(scale_by_std=True, eps=1e-6, unbiased=False)


def _rewards(means, std, answers, prompts=40, seed=0):
    """Gaussian rewards [B, K, N]: thought k's answers have mean means[k] and the same std."""
    generator = torch.Generator().manual_seed(seed)
    mu = torch.tensor(means, dtype=torch.float64)
    return mu[None, :, None] + std * torch.randn(prompts, len(means), answers, generator=generator, dtype=torch.float64)


def test_the_redraws_are_disjoint_slices_of_each_thoughts_answers():
    rewards = torch.arange(2 * 3 * 12, dtype=torch.float64).reshape(2, 3, 12)
    groups = variance.resample_groups(rewards, num_answers=4, resamples=3)
    assert groups.shape == (3, 2, 3, 4)
    assert torch.equal(groups[1, 0, 2], rewards[0, 2, 4:8])
    used = groups.permute(1, 2, 0, 3).reshape(2, 3, 12)
    assert torch.equal(used, rewards)  # every answer once: no redraw shares an answer with another
    with pytest.raises(ValueError, match="need 16 answers per thought; there are 12"):
        variance.resample_groups(rewards, num_answers=4, resamples=4)


def test_the_advantage_is_the_trainers_thought_advantage():
    groups = _rewards([0.1, 0.5, 0.9], 0.3, answers=8, prompts=5)[None]  # one redraw [1, B, K, M]
    values, advantages = variance.thought_values_and_advantages(groups, **NUMERICS)
    expected, _ = grpo_ma_advantages(groups[0], **NUMERICS)
    assert torch.equal(advantages[0], expected)
    assert torch.allclose(values[0], groups[0].mean(dim=-1))


def test_measured_value_variance_follows_s2_over_m():
    # Bernoulli-like 0/1 rewards with p = 0.5: a thought's value over M answers has variance 0.25 / M
    generator = torch.Generator().manual_seed(1)
    rewards = (torch.rand(30, 4, 400 * 8, generator=generator, dtype=torch.float64) < 0.5).double()
    results = variance.measure(rewards, (1, 2, 4, 8), resamples=400, **NUMERICS)
    for r in results:
        assert r.value_var == pytest.approx(0.25 / r.num_answers, rel=0.05)
        assert r.value_predicted == pytest.approx(0.25 / r.num_answers, rel=0.01)
        assert r.value_interval[0] <= r.value_var <= r.value_interval[1]


def test_the_delta_method_matches_the_measurement_where_the_noise_is_small():
    # well separated thoughts: at M = 16 a value's noise (0.2 / 4) is small against the spread of the values
    rewards = _rewards([0.0, 0.5, 1.0, 1.5], 0.2, answers=300 * 16, prompts=20)
    (large,) = variance.measure(rewards, (16,), resamples=300, **NUMERICS)
    assert large.advantage_var == pytest.approx(large.advantage_predicted, rel=0.1)
    # the law itself: four times the answers, a quarter of the variance
    (small,) = variance.measure(rewards, (4,), resamples=300, **NUMERICS)
    assert small.advantage_var / large.advantage_var == pytest.approx(4.0, rel=0.15)


def test_the_delta_method_is_the_linearised_normalisation():
    # two thoughts, population std: A = (v - mean) / (|v1 - v2| / 2) is +-1 for any values, so its derivative,
    # hence the predicted variance, is 0; three thoughts are not constant
    rewards = _rewards([0.0, 1.0], 0.3, answers=64, prompts=3)
    assert torch.allclose(variance.delta_method_advantage_variance(rewards, 4, **NUMERICS), torch.zeros(3, 2, dtype=torch.float64), atol=1e-9)
    three = _rewards([0.0, 1.0, 3.0], 0.3, answers=64, prompts=3)
    assert (variance.delta_method_advantage_variance(three, 4, **NUMERICS) > 0).all()


def test_bootstrap_interval_holds_the_mean_and_narrows_with_more_units():
    generator = torch.Generator().manual_seed(2)
    few, many = torch.rand(20, generator=generator), torch.rand(2000, generator=generator)
    low, high = variance.bootstrap_mean_interval(few)
    assert low < float(few.mean()) < high
    low_many, high_many = variance.bootstrap_mean_interval(many)
    assert high_many - low_many < (high - low) / 3


def test_outputs_round_trip(tmp_path):
    results = variance.measure(_rewards([0.0, 0.5, 1.0], 0.2, answers=8 * 4, prompts=4), (1, 2, 4), resamples=8, **NUMERICS)
    variance.write_outputs(results, {"prompts": 4}, tmp_path, 8)
    read, about = variance.read_outputs(tmp_path)
    assert read == results and about["resamples"] == 8
    assert (tmp_path / "variance.png").stat().st_size > 0
    assert json.loads((tmp_path / "variance.json").read_text())["results"][2]["num_answers"] == 4
    assert "| 4 |" in variance.table(results)


def test_cli_names_bad_values(tmp_path, capsys):
    assert variance.main([str(tmp_path), "--thoughts", "1", "--resamples", "1"]) == 2
    error = capsys.readouterr().err
    assert "--thoughts=1 must be >= 2" in error and "--resamples=1 must be >= 2" in error and "no config.yaml" in error


def test_right_thought_signal_compares_right_and_wrong_thoughts_on_prompts_with_both():
    # prompt 0: right thoughts (k = 0, 1) score 1.0 on average, wrong ones 0.0; prompt 1 has only right thoughts
    rewards = torch.tensor([[[1.0, 1.0], [0.5, 1.5], [0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0]] * 4], dtype=torch.float64)
    right = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    signal = variance.right_thought_signal(rewards, right, **NUMERICS)
    assert signal["prompts_with_both"] == 1 and signal["right_thoughts"] == 6 and signal["wrong_thoughts"] == 2
    assert signal["value_right"] == 1.0 and signal["value_wrong"] == 0.0
    assert signal["advantage_right"] == pytest.approx(1.0, abs=1e-5) and signal["advantage_wrong"] == pytest.approx(-1.0, abs=1e-5)
