"""Task samples -> a seeded, resumable prompt stream. No tensors here.

The stream is a pure function of (seed, position): epoch e visits the samples in the order of a permutation
drawn from ``random.Random(seed * 1_000_003 + e)``. Resuming needs only ``position``.
A ``TaskMixture`` draws each prompt's task by weight (a pure function of seed and draw number), then the
next sample of that task's own stream; its state is the draw count and every task stream's position.
"""

from __future__ import annotations

import math
import random

from vlm_grpo_ma.task_api.registry import Sample


class PromptStream:
    def __init__(self, samples: list[Sample], seed: int, position: int = 0):
        if not samples:
            raise ValueError("the prompt stream needs at least one sample; the task loaded none")
        self.samples = samples
        self.seed = seed
        self.position = position  # samples handed out so far, over all epochs
        self._epoch_order: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(range(len(self.samples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def next(self) -> Sample:
        epoch, offset = divmod(self.position, len(self.samples))
        self.position += 1
        return self.samples[self._order(epoch)[offset]]

    def take(self, count: int) -> list[Sample]:
        return [self.next() for _ in range(count)]

    @property
    def epoch(self) -> float:
        return self.position / len(self.samples)

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict) -> None:
        if "num_samples" not in state:
            raise ValueError(f"the checkpoint's data mixed tasks {sorted(state.get('streams', {}))}, this run draws one task")
        if state["num_samples"] != len(self.samples):
            raise ValueError(
                f"the checkpoint's data had {state['num_samples']} samples, this run loads {len(self.samples)}:"
                " resume with the same data.task/split/source"
            )
        self.seed = state["seed"]
        self.position = state["position"]


class TaskMixture:
    """Prompts from several tasks: draw ``i`` picks task ``name`` with probability ``weights[name] / sum``."""

    def __init__(self, streams: dict[str, PromptStream], weights: dict[str, float], seed: int):
        if set(streams) != set(weights) or not streams:
            raise ValueError(f"a task mixture needs one stream per weighted task, got {sorted(streams)} / {sorted(weights)}")
        bad = {name: w for name, w in weights.items() if not (w > 0 and math.isfinite(w))}
        if bad:  # an infinite weight would draw that task only
            raise ValueError(f"task mixture weights must be finite and > 0, got {bad}")
        self.streams = streams
        self.names = sorted(weights)
        total = sum(weights.values())
        self.cumulative = []
        running = 0.0
        for name in self.names:
            running += weights[name] / total
            self.cumulative.append(running)
        self.seed = seed
        self.draws = 0

    def _task_of_draw(self, draw: int) -> str:
        u = random.Random(self.seed * 1_000_003 + 7919 * draw + 1).random()
        return next((n for n, c in zip(self.names, self.cumulative, strict=True) if u < c), self.names[-1])

    def next(self) -> Sample:
        name = self._task_of_draw(self.draws)
        self.draws += 1
        return self.streams[name].next()

    def take(self, count: int) -> list[Sample]:
        return [self.next() for _ in range(count)]

    @property
    def samples(self) -> list[Sample]:
        return [s for name in self.names for s in self.streams[name].samples]

    @property
    def epoch(self) -> float:
        """The mean over the tasks of each task's own epoch."""
        return sum(stream.epoch for stream in self.streams.values()) / len(self.streams)

    def state_dict(self) -> dict:
        return {"draws": self.draws, "streams": {name: s.state_dict() for name, s in self.streams.items()}}

    def load_state_dict(self, state: dict) -> None:
        if "streams" not in state or set(state["streams"]) != set(self.streams):
            saved = sorted(state.get("streams", {})) or "one task"
            raise ValueError(f"the checkpoint's data mixed tasks {saved}, this run mixes {self.names}: resume with the same data.tasks")
        for name, stream_state in state["streams"].items():
            self.streams[name].load_state_dict(stream_state)
        self.draws = state["draws"]
