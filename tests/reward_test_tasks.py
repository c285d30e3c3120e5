"""Third-party style tasks for tests/test_rewards.py, in a light module that reward worker processes import
(a reward is sent to a worker by reference: module and name)."""

import os
import time
from pathlib import Path

from vlm_grpo_ma.task_api.registry import Task, register_task

# How long a "sleep" request hangs. A call that returns within HANG_S / 10 (a bound no loaded machine misses,
# and short of the pool's 120 s LOAD_LIMIT_S, which a running reward must not be held to) was cut off at its
# deadline, not waited out.
HANG_S = 600.0


def length_or_raise(completion, sample):
    """Raises on answers whose length is a multiple of 5; else the length / 10 and the worker's pid."""
    if len(completion.answer) % 5 == 0:
        raise RuntimeError("a buggy reward")
    return {"length": len(completion.answer) / 10, "pid": float(os.getpid())}


def hang_on_request(completion, sample):
    """Sleeps HANG_S seconds or busy-loops forever when the answer says so (writing its pid to
    ``sample.meta["pid_file"]`` first); else scores 1."""
    if completion.answer in ("sleep", "loop"):
        if sample.meta.get("pid_file"):
            Path(sample.meta["pid_file"]).write_text(str(os.getpid()))
        if completion.answer == "sleep":
            time.sleep(HANG_S)
            return {"ok": 1.0}
        while True:
            pass
    if completion.answer == "exit":
        os._exit(3)  # the worker dies
    return {"ok": 1.0}


def tag_after(completion, sample):
    """``{"tag": completion}`` after ``sample`` = (seconds, a file to create when the job starts, or None)."""
    seconds, started_file = sample
    if started_file:
        Path(started_file).touch()
    time.sleep(seconds)
    return {"tag": completion}


def images_seen(completion, sample):
    """How many images the reward was sent."""
    return {"images": float(len(sample.images))}


def no_ok_part(completion, sample):
    return {"other": 1.0}


for name, reward, weights in (
    ("length_or_raise", length_or_raise, {"length": 1.0}),
    ("hang_on_request", hang_on_request, {"ok": 1.0}),
    ("no_ok_part", no_ok_part, {"ok": 1.0}),
    ("images_seen", images_seen, {"images": 1.0}),
):
    register_task(Task(name, load=lambda *a: [], reward=reward, instruction="", reward_weights=weights))
