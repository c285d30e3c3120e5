"""The run's rollout engine (``rollout.engine``, see ``vlm_grpo_ma/engines``): refused before anything loads
where it cannot run here, and built from the run's settings."""

from __future__ import annotations

from vlm_grpo_ma.engines import ENGINES
from vlm_grpo_ma.run.config import Config, ConfigError


def check_engine(cfg: Config, num_processes: int) -> None:
    """Refuse, before anything loads, an engine that cannot run here: vllm without vLLM installed (naming the
    command that installs it) or with several processes."""
    if cfg.rollout.engine not in ENGINES:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is not valid; choose one of: {', '.join(ENGINES)}")
    if cfg.rollout.engine == "vllm":
        from vlm_grpo_ma.engines.vllm import check_vllm

        try:
            check_vllm(num_processes, tensor_parallel_size=cfg.rollout.vllm_tensor_parallel_size, sleep=cfg.rollout.vllm_sleep)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def make_engine(cfg: Config, policy):
    """The engine ``rollout.engine`` names, ready to sample with ``policy``'s current weights. vLLM's: the
    policy's model folder, the run's precision, then the policy's current weights (a resumed or LoRA run's
    differ from the folder's)."""
    check_engine(cfg, 1)
    if cfg.rollout.engine == "hf":
        from vlm_grpo_ma.engines.hf import HFEngine

        return HFEngine()
    from vlm_grpo_ma.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        policy.model.name_or_path,
        dtype="bfloat16" if cfg.train.mixed_precision == "bf16" else cfg.model.dtype,
        seed=cfg.train.seed,
        gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
        kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
        tensor_parallel_size=cfg.rollout.vllm_tensor_parallel_size,
        sleep=cfg.rollout.vllm_sleep,
        min_pixels=cfg.model.min_pixels,
        max_pixels=cfg.model.max_pixels,
    )
    engine.push_weights(policy)
    return engine
