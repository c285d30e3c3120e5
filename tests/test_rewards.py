"""Scoring a rollout: routing to each sample's task, raising rewards scored 0 and counted, threads or not."""

import threading

import pytest
import torch
from PIL import Image

from vlm_grpo_ma.policy import SamplingSettings, encode_prompt, prompt_generators
from vlm_grpo_ma.registry import Sample, Task, register_task
from vlm_grpo_ma.rewards import score_rollout
from vlm_grpo_ma.rollout import generate_rollout

SEEN_THREADS = set()


def _length_or_raise(completion, sample):
    SEEN_THREADS.add(threading.get_ident())
    if len(completion.answer) % 5 == 0:
        raise RuntimeError("a buggy reward")
    return {"length": len(completion.answer) / 10}


register_task(Task("length_or_raise", load=lambda *a: [], reward=_length_or_raise, instruction="", reward_weights={"length": 1.0}))


@pytest.fixture(scope="module")
def rollout(tiny_policy):
    samples = [Sample("length_or_raise", str(i), "Say something" + "!" * i, (Image.new("RGB", (56, 56), (40 * i, 0, 0)),), None)
               for i in range(3)]
    prompts = [encode_prompt(tiny_policy, s, "") for s in samples]
    settings = SamplingSettings(max_thought_tokens=6, max_answer_tokens=12, generators=prompt_generators(5, 0, 3))
    return generate_rollout(tiny_policy, samples, prompts, num_thoughts=2, num_answers=3, settings=settings)


def test_threads_score_exactly_what_one_thread_scores(rollout):
    SEEN_THREADS.clear()
    one = score_rollout(rollout, workers=1)
    assert len(SEEN_THREADS) == 1
    SEEN_THREADS.clear()
    many = score_rollout(rollout, workers=4)
    assert len(SEEN_THREADS) > 1  # the pool did run rewards in several threads
    assert torch.equal(one.rewards, many.rewards)
    assert one.per_answer_parts == many.per_answer_parts
    assert one.counters == many.counters


def test_a_raising_reward_scores_zero_and_is_counted(rollout):
    scored = score_rollout(rollout, workers=4)
    raised = [a for a, c in enumerate(rollout.completions) if len(c.answer) % 5 == 0]
    assert raised, "the sampled answers should include a length divisible by 5 (else pick another seed)"
    assert scored.counters["reward_errors"] == len(raised)
    flat = scored.rewards.flatten()
    for a, completion in enumerate(rollout.completions):
        ended = rollout.tree.thought_ended_turn[a // rollout.num_answers]
        expected = 0.0 if a in raised or ended else len(completion.answer) / 10
        assert float(flat[a]) == pytest.approx(expected)
