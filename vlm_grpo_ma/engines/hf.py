"""The ``hf`` rollout engine: the trainer's own model samples the tree (``decode.sample_tree``), so its
weights are always the trained ones and there is nothing to push."""

from __future__ import annotations

from vlm_grpo_ma.engines.rollout import generate_rollout


class HFEngine:
    name = "hf"
    samples_with_policy = True  # decodes with the trainer's model: the run gathers FSDP units and autocasts for it
    processes_per_engine = 1  # every process samples its own share
    metrics_prefix = None

    def sample(self, policy, samples, prompts, *, num_thoughts: int, num_answers: int, settings):
        return generate_rollout(policy, samples, prompts, num_thoughts=num_thoughts, num_answers=num_answers, settings=settings)

    def push_weights(self, policy) -> None:
        """Nothing: the HF engine samples with the trained model itself."""

    def sleep_until_push(self) -> None:
        """Nothing: the KV cache of a tree is freed when its sampling returns."""

    def close(self, orderly: bool) -> None:
        """Nothing to end."""

    def step_metrics(self) -> dict[str, float]:
        return {}
