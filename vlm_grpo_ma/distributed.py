"""Processes: the Accelerator of a run and the reductions of step figures over its processes."""

from __future__ import annotations

from collections import Counter

import torch

from vlm_grpo_ma import sharding
from vlm_grpo_ma.config import Config, ConfigError


def make_accelerator(cfg: Config):
    """accelerate's Accelerator for this run (DDP when launched with several processes). Refuses what the
    trainer cannot run and a step that does not split into whole prompt groups per process."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    # train() may run several times in one process (a notebook, a sweep) with another mixed precision:
    # accelerate keeps it in a process-wide singleton, so forget that (not the process group, PartialState).
    AcceleratorState._reset_state(reset_partial_state=False)
    sharding.launch_settings()  # an FSDP launch config the trainer does not run fails here, before any work
    with sharding.accelerate_without_fsdp():  # FSDP: the trainer shards itself (vlm_grpo_ma/sharding.py)
        accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            mixed_precision=cfg.train.mixed_precision,
            # a process whose prompts of a step have no image leaves the vision tower unused: DDP must then
            # look for unused parameters (a graph walk every backward), but only if the tower trains
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=cfg.model.lora_rank == 0 and not cfg.model.freeze_vision)],
        )
    if accelerator.distributed_type.value == "DEEPSPEED":
        raise ConfigError(
            "accelerate distributed_type DEEPSPEED is not supported; use FSDP2 (configs/accelerate/fsdp.yaml) "
            "or data parallelism (configs/accelerate/ddp.yaml)"
        )
    if cfg.train.prompts_per_step % accelerator.num_processes:
        raise ConfigError(
            f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the "
            f"{accelerator.num_processes} processes: each process takes an equal share of the step's prompts "
            "(whole K x M groups)"
        )
    return accelerator


def sum_over_processes(accelerator, counts: Counter) -> Counter:
    """Counters summed over the processes (every process gets the total)."""
    if accelerator.num_processes == 1:
        return counts
    from accelerate.utils import gather_object

    total = Counter()
    for part in gather_object([dict(counts)]):
        total.update(part)
    return total


def mean_over_processes(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Step metrics averaged over the processes that logged them (each holds an equal share of the step's
    prompts), except ``*_max`` (the maximum) and ``count/*`` (already the same everywhere). ``reward/std``
    becomes the mean of the per-process standard deviations."""
    if accelerator.num_processes == 1:
        return metrics
    from accelerate.utils import gather_object

    parts = gather_object([metrics])
    merged = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        values = [part[key] for part in parts if key in part]
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key.startswith("count/"):
            merged[key] = values[0]
        else:
            merged[key] = sum(values) / len(values)
    return merged

