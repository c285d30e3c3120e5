"""The ``hf`` rollout engine: the trainer's own model samples the tree (``decode.sample_tree``), so its
weights are always the trained ones and there is nothing to push."""

from __future__ import annotations

from vlm_grpo_ma.engines.rollout import generate_rollout


class HFEngine:
    name = "hf"

    def sample(self, policy, samples, prompts, *, num_thoughts: int, num_answers: int, settings):
        return generate_rollout(policy, samples, prompts, num_thoughts=num_thoughts, num_answers=num_answers, settings=settings)

    def push_weights(self, policy) -> None:
        """Nothing: the HF engine samples with the trained model itself."""

    def step_metrics(self) -> dict[str, float]:
        return {}
