import pytest

from vlm_grpo_ma.data import PromptStream
from vlm_grpo_ma.registry import Sample


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
