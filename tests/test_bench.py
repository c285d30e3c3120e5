"""The rollout benchmark: the re-encode baseline must be the same model computing the same distribution as
the branched path, or its timings compare different work."""

from __future__ import annotations

import pytest
import torch

from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
from vlm_grpo_ma.model.logprobs import _policy_logprobs
from vlm_grpo_ma.tools.bench import bench_rollout, reencode_answers, run_branched
from vlm_grpo_ma.tools.bench_inputs import BenchTree, bench_prompts, load_bench_policy

K, M = 2, 2
THOUGHT_TOKENS, ANSWER_TOKENS = 6, 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    # One thread: this checks numbers, not speed, and on a busy 2-core machine two OpenMP threads contending
    # with other processes make each tiny matmul take milliseconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    policy = load_bench_policy("random-tiny", tmp_path_factory.mktemp("bench"))
    yield policy, bench_prompts(policy, 1)
    torch.set_num_threads(threads)


def test_rollout_benchmark_paths_agree(tiny_policy):
    policy, prompts = tiny_policy
    result = bench_rollout(
        policy, prompts, BenchTree(num_thoughts=K, num_answers=M, max_thought_tokens=THOUGHT_TOKENS, max_answer_tokens=ANSWER_TOKENS, repeats=1, warmup=0)
    )
    assert result["num_answers_branched"] == result["num_answers_reencode"] == K * M
    assert len(result["first_token_logprobs_reencode"]) == K * M
    assert result["thoughts_identical"]  # same seed, same stage-1 code
    # (b)'s log-prob of (a)'s first answer token, after prefilling prompt + image + thought from scratch,
    # equals (a)'s sampling log-prob from the branched cache.
    assert result["first_token_max_abs_diff"] <= TOLERANCE
    # the report's figures are the timed repeats' medians, and the ratio is re-encode over branched
    assert result["branched_all_s"] == [result["branched_s"]] and result["reencode_all_s"] == [result["reencode_s"]]
    assert result["ratio"] == result["reencode_s"] / result["branched_s"]
    assert result["answer_ratio"] == result["reencode_answer_s"] / result["branched_answer_s"]
    assert 1 <= result["answer_tokens_mean_reencode"] <= ANSWER_TOKENS


def test_first_token_check_can_fail(tiny_policy):
    """Negative control for the tolerance above: the untrained model's distribution is nearly flat, so show
    that re-encoding a wrong context (each thought without its first token) misses by more than it."""
    policy, prompts = tiny_policy

    def settings():
        return SamplingSettings(
            max_thought_tokens=THOUGHT_TOKENS,
            max_answer_tokens=ANSWER_TOKENS,
            generators=prompt_generators(0, 0, len(prompts)),
        )

    _, tree = run_branched(policy, prompts, num_thoughts=K, num_answers=M, settings=settings())
    first_tokens = torch.tensor([ids[0] for ids in tree.answer_ids])
    branched = torch.tensor([lp[0] for lp in tree.answer_logprobs])

    def reencoded(thoughts):
        *_, logits = reencode_answers(
            policy, prompts, thoughts, num_thoughts=K, num_answers=M, settings=settings()
        )
        logprobs = _policy_logprobs(logits, 1.0, policy.suppressed_token_ids)
        return logprobs.gather(-1, first_tokens[:, None]).squeeze(-1)

    assert (reencoded(tree.thought_ids) - branched).abs().max() <= TOLERANCE
    assert (reencoded([ids[1:] for ids in tree.thought_ids]) - branched).abs().max() > 10 * TOLERANCE


def test_the_embedded_model_is_benchmarked_as_the_default_run_loads_it(tmp_path):
    """``embedded`` times the shipped weights: they stop their thoughts at "</think>" well before the limit,
    as in the default run, and the two paths still do the same work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = load_bench_policy("embedded", tmp_path)
        result = bench_rollout(policy, bench_prompts(policy, 2), BenchTree(num_thoughts=K, num_answers=M, repeats=1, warmup=0))
    finally:
        torch.set_num_threads(threads)
    assert result["thought_tokens_mean"] < result["max_thought_tokens"]
    assert result["thoughts_identical"] and result["first_token_max_abs_diff"] <= TOLERANCE
    assert result["answers_identical_fraction"] == 1.0


def test_an_unknown_benchmark_model_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="'20m'.*embedded, random-tiny, random-10m"):
        load_bench_policy("20m", tmp_path)


def test_training_forward_benchmark_paths_agree_and_count_the_tokens(tiny_policy):
    """``bench train``: both forwards give the same log-probs and gradients, and the shared one encodes
    each micro-batch's prompts and thoughts once (counted from the tree, not from either path)."""
    from vlm_grpo_ma.tools.bench import bench_train
    from vlm_grpo_ma.tools.bench_inputs import BenchTree

    policy, prompts = tiny_policy
    prompts = bench_prompts(policy, 2)
    tree = BenchTree(num_thoughts=K, num_answers=M, max_thought_tokens=THOUGHT_TOKENS, max_answer_tokens=ANSWER_TOKENS, repeats=1, warmup=0)
    result = bench_train(policy, prompts, tree, micro_batch_rows=K * M)
    assert result["logprob_max_abs_diff"] <= TOLERANCE
    assert result["grad_max_abs_diff_relative"] <= 1e-4
    prompt = result["prompt_tokens_mean"]
    thought, answer = result["thought_tokens_mean"], result["answer_tokens_mean"]
    rows = 2 * K * M  # one micro-batch per prompt
    assert result["tokens_encoded_reencode"] == pytest.approx(rows * (prompt + thought + answer))
    assert result["tokens_encoded_shared"] == pytest.approx(2 * prompt + 2 * K * thought + rows * answer)
    assert result["shared_all_s"] == [result["shared_s"]] and result["reencode_all_s"] == [result["reencode_s"]]
    assert result["ratio"] == result["reencode_s"] / result["shared_s"]
