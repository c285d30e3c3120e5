"""The run's rollout engine (``rollout.engine``, see ``vlm_grpo_ma/engines``): refused before anything loads
where it cannot run here, and built from the run's settings."""

from __future__ import annotations

from pathlib import Path

from vlm_grpo_ma.engines import ENGINES
from vlm_grpo_ma.model.loading import resolve_model_path
from vlm_grpo_ma.run.config import Config, ConfigError


def check_engine(cfg: Config, num_processes: int) -> None:
    """Refuse, before anything loads, an engine that cannot run here: vllm without vLLM installed (naming the
    command that installs it), installed but not importing, a tensor-parallel size that does not divide
    the launch's processes, or a Qwen3.5 folder in another dtype than bfloat16 on a CPU."""
    if cfg.rollout.engine not in ENGINES:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is not valid; choose one of: {', '.join(ENGINES)}")
    if cfg.rollout.engine == "vllm":
        from vlm_grpo_ma.engines.vllm import check_hybrid_dtype, check_vllm

        try:
            check_vllm(num_processes, tensor_parallel_size=cfg.rollout.vllm_tensor_parallel_size, sleep=cfg.rollout.vllm_sleep)
            folder = Path(resolve_model_path(cfg.model.name_or_path))
            if (folder / "config.json").is_file():  # a local model (a hub id is read when the engine starts)
                check_hybrid_dtype(str(folder), engine_dtype(cfg))
        except ValueError as error:
            raise ConfigError(str(error)) from None


def engine_dtype(cfg: Config) -> str:
    """The vLLM engine's weights: bf16 under bf16 autocast, else the model's dtype."""
    return "bfloat16" if cfg.train.mixed_precision == "bf16" else cfg.model.dtype


def media_room(cfg: Config, tasks, samples) -> tuple[int, int, int]:
    """What an engine must make room for, from the run's data: (the most images a prompt holds, the most videos, the
    crops a thought may get back: ``rollout.max_turns`` where a task has tools, else 0). Both the trainers' setup
    and an engine process (``engine_process.py``) read it."""
    tool_images = cfg.rollout.max_turns if any(task.tools for task in tasks.values()) else 0
    return max(len(s.images) for s in samples), max(len(s.videos) for s in samples), tool_images


def make_engine(cfg: Config, policy, *, max_images: int = 1, max_videos: int = 0, num_processes: int = 1,
                process_index: int = 0):
    """The engine ``rollout.engine`` names, ready to sample with ``policy``'s current weights. vLLM's (one per
    group of ``rollout.vllm_tensor_parallel_size`` processes of the launch): the policy's model folder, the
    run's precision, room for ``max_images`` images and ``max_videos`` videos a prompt (the data's most), then
    the policy's current weights (a resumed or LoRA run's differ from the folder's). Every process of a launch
    calls it."""
    check_engine(cfg, num_processes)
    if cfg.rollout.engine == "hf":
        from vlm_grpo_ma.engines.hf import HFEngine

        return HFEngine()
    from vlm_grpo_ma.engines.vllm import VLLMEngine

    try:  # a model whose videos vLLM cannot read here (VLLMEngine.check_videos): one line, at the start
        engine = VLLMEngine(
            policy.model.name_or_path,
            dtype=engine_dtype(cfg),
            seed=cfg.train.seed,
            gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
            kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
            tensor_parallel_size=cfg.rollout.vllm_tensor_parallel_size,
            num_processes=num_processes,
            process_index=process_index,
            max_images=max(max_images, 1),
            max_videos=max_videos,
            sleep=cfg.rollout.vllm_sleep,
            min_pixels=cfg.model.min_pixels,
            max_pixels=cfg.model.max_pixels,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    engine.push_weights(policy)
    return engine
