"""Task samples -> a seeded, resumable prompt stream. No tensors here.

The stream is a pure function of (seed, position): epoch e visits the samples in the order of a permutation
drawn from ``random.Random(seed * 1_000_003 + e)``. Resuming needs only ``position``.
"""

from __future__ import annotations

import random

from vlm_grpo_ma.registry import Sample


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
        if state["num_samples"] != len(self.samples):
            raise ValueError(
                f"the checkpoint's data had {state['num_samples']} samples, this run loads {len(self.samples)}:"
                " resume with the same data.task/split/source"
            )
        self.seed = state["seed"]
        self.position = state["position"]
