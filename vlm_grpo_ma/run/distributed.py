"""Processes: the Accelerator of a run and the reductions of step figures over its processes."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter

import torch

from vlm_grpo_ma.run import sharding
from vlm_grpo_ma.run.config import Config, ConfigError

# The loggers whose warnings report a failure on one process alone: a reward that raised on its answers, a sample
# of its share of the held-out set, a signal it received. The rest say what every process would say alike (a broken
# training image is said by the main process, which learns every process's: loop.draw_prompts).
OWN_LOGGERS = ("vlm_grpo_ma.run.rewards", "vlm_grpo_ma.evaluate", "vlm_grpo_ma.survive")


def launch_rank() -> int:
    """This process's rank in a launch (0 outside one), read from the launcher's environment (torchrun's RANK, or
    MPI's) as accelerate reads it, so it is known before the process group exists: the command line's errors."""
    from accelerate.utils.environment import get_cpu_distributed_information

    return get_cpu_distributed_information().rank


def quiet_other_processes(rank: int) -> None:
    """Several processes say INFO and WARNING once, on the main process (rank 0): on every other process the
    project's loggers pass errors only, except ``OWN_LOGGERS``, which pass warnings too (that process's own
    failures), and transformers' logs and progress bars (loading the weights) are off. Nothing changes on rank 0."""
    if rank == 0:
        return
    import transformers

    logging.getLogger("vlm_grpo_ma").setLevel(logging.ERROR)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def make_accelerator(cfg: Config):
    """accelerate's Accelerator for this run (DDP when launched with several processes). Refuses what the
    trainer cannot run and a step that does not split into whole prompt groups per process."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    # train() may run several times in one process (a notebook, a sweep) with another mixed precision:
    # accelerate keeps it in a process-wide singleton, so forget that (not the process group, PartialState).
    AcceleratorState._reset_state(reset_partial_state=False)
    sharding.launch_settings()  # an FSDP launch config the trainer does not run fails here, before any work
    with sharding.accelerate_without_fsdp():  # FSDP: the trainer shards itself (vlm_grpo_ma/run/sharding.py)
        accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            mixed_precision=cfg.train.mixed_precision,
            kwargs_handlers=[ddp_settings()],
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


@contextlib.contextmanager
def process_group_left_at_the_end():
    """Around a launched run's ``train()``: when it returns, or stops at a point every process reached
    (``survive.together`` marks such errors ``stopped_together``), or on a ConfigError (a refusal of the
    trainer's own checks, never raised inside a collective; at start every process meets it alike), destroy the
    process group before the interpreter exits. Left to interpreter teardown, gloo's worker threads are
    destroyed joinable now and then, and the process aborts (SIGABRT, "terminate called without an active
    exception") instead of exiting with the run's code. After another error on one process alone the group is
    left as it is: that process may have a collective in flight, which destroying it could wait on."""
    try:
        yield
    except BaseException as error:
        if getattr(error, "stopped_together", False) or isinstance(error, ConfigError):
            _destroy_process_group()
        raise
    _destroy_process_group()


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def ddp_settings():
    """How DDP wraps the scorer. Every trained parameter gets a gradient in every backward: frozen modules
    (the base under LoRA, a frozen vision tower) have requires_grad False, which DDP leaves out, and no module is
    skipped (a micro-batch without images runs the vision tower on a blank image, ``prompts.idle_vision_term``).
    So DDP need not search the graph for unused parameters after every backward (``find_unused_parameters``
    off; a skipped trained parameter would make DDP raise at the next step, not train wrongly), and the
    gradients live in DDP's communication buckets (``gradient_as_bucket_view``) instead of a second copy."""
    from accelerate.utils import DistributedDataParallelKwargs

    return DistributedDataParallelKwargs(find_unused_parameters=False, gradient_as_bucket_view=True)


def main_process_value(accelerator, value):
    """The main process's ``value`` on every process (what the others pass is ignored)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import gather_object

    return gather_object([value])[0]


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

