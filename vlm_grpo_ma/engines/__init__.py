"""Rollout engines: what samples a step's K x M tree (``rollout.engine``).

Every engine returns the same ``Rollout`` (ids, sampling log-probs, thought/answer structure), so rewards,
advantages, the batch and the update do not know which one sampled. ``hf`` (``hf.py``) is the KV-branching
decode loop of ``policy.sample_tree``; ``vllm`` (``vllm.py``) an in-process vLLM engine that samples the tree
through its prefix cache and gets the policy's weights after every update.

An engine has three calls: ``sample(policy, samples, prompts, num_thoughts=, num_answers=, settings=)`` ->
Rollout; ``push_weights(policy)`` after each update; ``step_metrics()`` -> figures of the last step.
"""

from __future__ import annotations

from vlm_grpo_ma.run.config import Config, ConfigError

ENGINES = ("hf", "vllm")


def check_engine(cfg: Config, num_processes: int) -> None:
    """Refuse, before anything loads, an engine that cannot run here: vllm without vLLM installed (naming the
    command that installs it) or with several processes."""
    if cfg.rollout.engine not in ENGINES:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is not valid; choose one of: {', '.join(ENGINES)}")
    if cfg.rollout.engine == "vllm":
        from vlm_grpo_ma.engines.vllm import check_vllm

        check_vllm(cfg, num_processes)


def make_engine(cfg: Config, policy):
    """The engine ``rollout.engine`` names, ready to sample with ``policy``'s current weights."""
    check_engine(cfg, 1)
    if cfg.rollout.engine == "hf":
        from vlm_grpo_ma.engines.hf import HFEngine

        return HFEngine()
    from vlm_grpo_ma.engines.vllm import VLLMEngine

    return VLLMEngine.for_run(cfg, policy)
