"""Scoring a rollout: routing to each sample's task, in worker processes under a deadline; raising rewards and
rewards past their deadline scored 0 and counted; the result independent of the number of workers."""

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import reward_test_tasks  # noqa: F401 - registers the test tasks
import torch

from vlm_grpo_ma.engines.rollout import Rollout
from vlm_grpo_ma.run.rewards import score_rollout, task_reward
from vlm_grpo_ma.task_api.registry import Completion, Sample, Task, get_task, register_task
from vlm_grpo_ma.task_api.reward_pool import RewardError, RewardPool, RewardTimeout

# No wall-clock limit here that a loaded machine can miss (issue 45): a deadline is shown by what it produces
# (score 0, the timeout counted, the worker killed), and a call is shown not to have waited out a hang by
# returning within a tenth of it (reward_test_tasks.HANG_S).
WAIT_S = reward_test_tasks.HANG_S / 10


def make_rollout(task: str, answers: list[list[str]], num_answers: int, meta: dict | None = None) -> Rollout:
    """One sample per prompt; ``answers[b]`` is prompt b's K * M answers in answer-row order."""
    num_thoughts = len(answers[0]) // num_answers
    samples = [Sample(task, str(b), "q", (), "6", dict(meta or {})) for b in range(len(answers))]
    completions = [Completion(thought="<think>t</think>", answer=text) for row in answers for text in row]
    rows = len(answers) * num_thoughts
    tree = SimpleNamespace(thought_ended_turn=[False] * rows, thought_truncated=[False] * rows, thought_ids=[[]] * rows,
                           thought_over_turns=[False] * rows, thought_turns=[[]] * rows)
    return Rollout(samples, [None] * len(samples), num_thoughts, num_answers, tree, completions)


LENGTH_ANSWERS = [["a" * (3 * b + i) for i in range(1, 7)] for b in range(3)]  # lengths 1..12, some % 5 == 0


def test_workers_score_exactly_what_one_worker_scores():
    rollout = make_rollout("length_or_raise", LENGTH_ANSWERS, num_answers=3)
    one = score_rollout(rollout, workers=1)
    many = score_rollout(rollout, workers=4)
    assert len({p["pid"] for p in one.per_answer_parts if "pid" in p}) == 1
    assert len({p["pid"] for p in many.per_answer_parts if "pid" in p}) > 1  # several processes did score
    assert torch.equal(one.rewards, many.rewards)
    without_pid = [[{k: v for k, v in p.items() if k != "pid"} for p in s.per_answer_parts] for s in (one, many)]
    assert without_pid[0] == without_pid[1]
    assert one.counters == many.counters
    assert os.getpid() not in {p["pid"] for p in many.per_answer_parts if "pid" in p}  # not in this process


def test_a_raising_reward_scores_zero_and_is_counted():
    rollout = make_rollout("length_or_raise", LENGTH_ANSWERS, num_answers=3)
    scored = score_rollout(rollout, workers=4)
    raised = [a for a, c in enumerate(rollout.completions) if len(c.answer) % 5 == 0]
    assert raised
    assert scored.counters["reward_errors"] == len(raised)
    assert scored.counters["reward_timeouts"] == 0
    for a, completion in enumerate(rollout.completions):
        expected = 0.0 if a in raised else len(completion.answer) / 10
        assert float(scored.rewards.flatten()[a]) == pytest.approx(expected)


def test_missing_weighted_part_is_an_error():
    scored = score_rollout(make_rollout("no_ok_part", [["x", "y"]], num_answers=1), workers=2)
    assert scored.counters["reward_errors"] == 2 and scored.rewards.sum() == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(("how", "workers"), [("sleep", 1), ("loop", 3)])
def test_a_reward_past_its_deadline_scores_zero_is_counted_and_killed(how, workers, tmp_path):
    """Planted, each alone (HANG_S = 5): no deadline (the sleep was waited out and scored 1; the loop never
    returned); a running reward held to LOAD_LIMIT_S = 120 s (scored 0 and counted, but after 120 s); the
    stuck worker left running."""
    pid_file = tmp_path / "pid"
    answers = [["ok", how, "ok", "ok"], ["ok", "ok", "ok", "ok"]]
    rollout = make_rollout("hang_on_request", answers, num_answers=2, meta={"pid_file": str(pid_file)})
    started = time.monotonic()
    scored = score_rollout(rollout, workers=workers, timeout_s=0.3)
    assert time.monotonic() - started < WAIT_S  # cut off, not waited out
    assert scored.counters["reward_timeouts"] == 1 and scored.counters["reward_errors"] == 0
    assert scored.rewards.flatten().tolist() == [1, 0, 1, 1, 1, 1, 1, 1]
    assert scored.per_answer_parts[1] == {"reward": 0.0}
    # the stuck worker was killed, and reaped before the call returned
    assert not _alive(int(pid_file.read_text())), "the worker stuck in the reward still runs"
    again = score_rollout(make_rollout("hang_on_request", [["ok", "ok"]], num_answers=1), workers=workers)
    assert again.rewards.flatten().tolist() == [1, 1]  # the pool carries on with a replacement worker


def test_the_call_after_an_interrupted_one_returns_its_own_results(tmp_path):
    pool = RewardPool()
    started = [tmp_path / f"old-{i}" for i in range(2)]
    old_jobs = [(reward_test_tasks.tag_after, f"old-{i}", (2.0, str(started[i]))) for i in range(2)]

    def interrupt_when_both_run():  # Ctrl-C in the trainer while both workers are inside a reward
        while not all(path.exists() for path in started):
            time.sleep(0.01)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Ctrl-C as a terminal delivers it, whatever handler an earlier test in this process left behind
    handler_before = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_when_both_run, daemon=True).start()
    try:
        try:
            outcomes = pool.run(old_jobs, workers=2, timeout_s=30)
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail(f"the call was not interrupted: outcomes {outcomes}, started files {[p.exists() for p in started]}, "
                        f"SIGINT handler before the test {handler_before}")
        new_jobs = [(reward_test_tasks.tag_after, f"new-{i}", (0.0, None)) for i in range(2)]
        assert pool.run(new_jobs, workers=2, timeout_s=30) == [({"tag": "new-0"}, None), ({"tag": "new-1"}, None)]
    finally:
        signal.signal(signal.SIGINT, handler_before)
        pool.close()


def test_a_worker_that_dies_scores_zero_and_is_counted():
    scored = score_rollout(make_rollout("hang_on_request", [["ok", "exit", "ok", "ok"]], num_answers=2), workers=2)
    assert scored.counters["reward_errors"] == 1 and scored.rewards.flatten().tolist() == [1, 0, 1, 1]


def test_a_lambda_reward_runs_here_under_the_deadline():
    register_task(Task("lambda_reward", load=lambda *a: [], reward=lambda c, s: {"ok": float(c.answer == "y")},
                       instruction="", reward_weights={"ok": 1.0}))
    scored = score_rollout(make_rollout("lambda_reward", [["y", "n"]], num_answers=1), workers=2)
    assert scored.rewards.flatten().tolist() == [1, 0]


GAMMA = r"\Gamma(\Gamma(\Gamma(5)))"


def test_a_hanging_reward_from_a_thread_finishes_within_the_deadline():
    """A reward that never finishes (sympy on an answer its screen missed, say), called from a thread, where a
    SIGALRM timer does nothing: the worker's deadline still ends it. Planted: no deadline (the reward did not
    come back)."""
    task = get_task("hang_on_request")
    sample = Sample("hang_on_request", "g", "q", (), None, {})
    result = []
    thread = threading.Thread(
        target=lambda: result.append(task_reward(task, task.reward_weights, Completion("t", "loop"), sample, timeout_s=1.0))
    )
    thread.start()
    thread.join(WAIT_S)  # the loop never ends: only the deadline (+ a fresh worker's start) brings it back
    assert result, "the reward did not come back"
    parts, reward, error = result[0]
    assert isinstance(error, RewardTimeout) and reward == 0.0 and parts == {}


def test_hostile_math_through_score_rollout_with_workers():
    """GAMMA ran until the deadline before issue 23; the grammar (a command the truth lacks) and the screen now
    refuse it: scored 0 without a timeout, within a tenth of a deadline it would have run to. Planted: both
    refusals off (math_verify_equal without the screen, is_equivalent without the grammar's refusal): a
    timeout, after the whole deadline."""
    answers = [[f"<answer>{GAMMA}</answer>", "<answer>6</answer>", "<answer>7</answer>", "<answer>6</answer>"]]
    rollout = make_rollout("math", answers, num_answers=2)
    score_rollout(make_rollout("math", [["<answer>1+1</answer>"] * 2], num_answers=1), workers=2)  # import sympy
    started = time.monotonic()
    scored = score_rollout(rollout, workers=2, timeout_s=reward_test_tasks.HANG_S)
    assert time.monotonic() - started < WAIT_S
    assert scored.counters["reward_timeouts"] == 0
    assert scored.parts["accuracy"].flatten().tolist() == [0, 1, 0, 1]


def test_task_reward_reports_errors():
    task = get_task("length_or_raise")
    parts, reward, error = task_reward(task, task.reward_weights, Completion("", "abcde"), Sample("length_or_raise", "0", "q", (), None))
    assert (parts, reward) == ({}, 0.0) and isinstance(error, RewardError) and "a buggy reward" in str(error)


def test_a_reward_is_sent_no_pixels_and_the_sample_stays_undecoded():
    """Pickling a lazily opened image decoded it: a 0.7 MB JPEG travelled as 3.7 MB per answer and stayed decoded
    in the trainer's sample. Planted: the sample sent with its images; the reward saw 1 image and the sample's
    image was loaded."""
    import io
    import pickle

    from PIL import Image

    from vlm_grpo_ma.run.rewards import _without_images
    from vlm_grpo_ma.task_api.images import open_lazily

    buffer = io.BytesIO()
    Image.new("RGB", (512, 512), (10, 200, 30)).save(buffer, format="JPEG")
    image = open_lazily(buffer.getvalue(), "test")
    sample = Sample("images_seen", "s", "q", (image,), None)
    parts, reward, error = task_reward(get_task("images_seen"), {"images": 1.0}, Completion("", ""), sample, timeout_s=30)
    assert error is None and parts == {"images": 0.0}
    assert getattr(image, "_im", None) is None  # still only the header and the encoded bytes
    assert len(pickle.dumps(_without_images(sample))) < 1000
