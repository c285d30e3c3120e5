import pytest

from vlm_grpo_ma.task_api.registry import Sample
from vlm_grpo_ma.task_api.streams import PromptStream


def _samples(n):
    return [Sample("t", str(i), "q", (), None) for i in range(n)]


def test_each_epoch_visits_every_sample_once_in_a_seeded_order():
    stream = PromptStream(_samples(10), seed=3)
    first, second = [s.id for s in stream.take(10)], [s.id for s in stream.take(10)]
    assert sorted(first) == sorted(second) == sorted(str(i) for i in range(10))
    assert first != second  # a new permutation each epoch
    assert first == [s.id for s in PromptStream(_samples(10), seed=3).take(10)]
    assert first != [s.id for s in PromptStream(_samples(10), seed=4).take(10)]


def test_resume_continues_the_same_order():
    straight = PromptStream(_samples(7), seed=1)
    expected = [s.id for s in straight.take(17)]
    part = PromptStream(_samples(7), seed=1)
    head = [s.id for s in part.take(9)]
    resumed = PromptStream(_samples(7), seed=99)
    resumed.load_state_dict(part.state_dict())
    assert head + [s.id for s in resumed.take(8)] == expected


def test_resume_with_other_data_is_refused():
    state = PromptStream(_samples(7), seed=1).state_dict()
    with pytest.raises(ValueError, match="7 samples"):
        PromptStream(_samples(8), seed=1).load_state_dict(state)


def test_empty_data_is_refused():
    with pytest.raises(ValueError, match="at least one sample"):
        PromptStream([], seed=0)


def _task_samples(task, n):
    return [Sample(task, f"{task}{i}", "q", (), None) for i in range(n)]


def _mixture(seed=0, weights=None):
    from vlm_grpo_ma.task_api.streams import TaskMixture

    weights = weights or {"a": 3.0, "b": 1.0}
    streams = {name: PromptStream(_task_samples(name, 5), seed=seed) for name in weights}
    return TaskMixture(streams, weights, seed=seed)


def test_task_mixture_draws_tasks_by_weight():
    tasks = [s.task for s in _mixture().take(4000)]
    share_a = tasks.count("a") / len(tasks)
    assert 0.72 < share_a < 0.78  # 3:1 -> 0.75; binomial sd over 4000 draws is 0.007
    first_a = [s.id for s in _mixture().take(40) if s.task == "a"][:5]
    assert sorted(first_a) == [f"a{i}" for i in range(5)]  # each task walks its own stream, one epoch at a time


def test_task_mixture_resumes_exactly():
    expected = [s.id for s in _mixture(seed=2).take(30)]
    part = _mixture(seed=2)
    head = [s.id for s in part.take(13)]
    resumed = _mixture(seed=2)
    resumed.load_state_dict(part.state_dict())
    assert head + [s.id for s in resumed.take(17)] == expected


def test_task_mixture_refuses_another_mixture_state():
    state = _mixture(weights={"a": 1.0, "b": 1.0}).state_dict()
    with pytest.raises(ValueError, match=r"mixed tasks \['a', 'b'\], this run mixes \['a', 'c'\]"):
        _mixture(weights={"a": 1.0, "c": 1.0}).load_state_dict(state)
