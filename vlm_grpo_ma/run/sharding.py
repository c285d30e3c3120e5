"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) for full fine-tuning past one
device, and LoRA under it.

When it is on: ``accelerate launch`` with a config of ``distributed_type: FSDP`` and ``fsdp_version: 2``
(``configs/accelerate/fsdp.yaml``, ``cpu-2proc-fsdp.yaml``) and more than one process. The launcher exports
its FSDP settings (``ACCELERATE_USE_FSDP``, ``FSDP_*``); ``launch_settings`` reads them and the trainer shards
the model itself with ``fully_shard``, not through accelerate's FSDP plugin, for two reasons: the plugin
refuses CPU processes (accelerate falls back to DDP with ``cpu=True``), so it could not be proven on CPU;
and the rollout calls the vision tower, decoder and ``lm_head`` directly, which needs control over when
parameters are gathered (``gathered``).

The layout (``shard``): one FSDP unit per decoder layer and per vision block (the model's own
``_no_split_modules``, or the launch config's ``fsdp_transformer_layer_cls_to_wrap``), and the
``CompletionScorer`` as the root unit holding the rest (embeddings, ``lm_head``, final norm, the vision
patch embedding and merger). The root is the scorer, not the model: the training forward
(``shared_prefix_logprobs`` / ``sequence_logprobs``) runs entirely inside ``scorer.forward``, so the root's
pre-forward hook gathers the root parameters for the direct calls into ``model.model`` and ``lm_head``,
and each layer's own hooks gather that layer, as in any FSDP2 model. Gradients are reduce-scattered
(averaged over processes, as DDP averages them) in the backward of each step's last micro-batch only
(``sync_gradients``).

Sampling and evaluation run outside the scorer's forward: ``gathered`` all-gathers every unit once, keeps
them gathered for the whole rollout (no re-gather per decoded token) and frees them after.

Checkpoints (``save_checkpoint``): the model as a plain Hugging Face folder (full weights, or the LoRA
adapter, gathered on rank 0: ``evaluate`` and ``--resume`` load it as any checkpoint) and the optimizer
state sharded with ``torch.distributed.checkpoint`` in ``optimizer/`` (each rank writes its shard; a
resume with another number of processes reshards it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_grpo_ma.model import lora
from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run import survive
from vlm_grpo_ma.run.config import ConfigError

SHARDED_OPTIMIZER = "sharded: optimizer/"  # the training state's "optimizer" entry of an FSDP checkpoint
OPTIMIZER_FOLDER = "optimizer"
log = logging.getLogger("vlm_grpo_ma.sharding")


@dataclass(frozen=True)
class FSDPSettings:
    """What the trainer takes from the launch config's FSDP section."""

    wrap_classes: tuple[str, ...] = ()  # empty: the model's _no_split_modules
    reshard_after_forward: bool = True  # full shard; False keeps each unit gathered from forward to backward


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} from the accelerate launch config: expected true or false")


def fsdp_requested() -> bool:
    """The launch config says ``distributed_type: FSDP`` (``accelerate launch`` exports ACCELERATE_USE_FSDP)."""
    return _env_flag("ACCELERATE_USE_FSDP", False)


def launch_settings() -> FSDPSettings | None:
    """The FSDP settings of this launch, or None without FSDP. Refuses the settings the trainer does not
    build, naming the value and the ones it runs."""
    if not fsdp_requested():
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(f"fsdp_version: {version} in the accelerate launch config; the trainer runs fsdp_version: 2 (FSDP2)")
    refused = {
        "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params: true (CPU offload is not built; use false)",
        "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing: true (use model.gradient_checkpointing=true instead, and false here)",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "fsdp_cpu_ram_efficient_loading: true (every rank loads the model; use false)",
    }
    for name, why in refused.items():
        if _env_flag(name, False):
            raise ConfigError(f"{why} in the accelerate launch config is not supported")
    classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    return FSDPSettings(
        wrap_classes=tuple(c.strip() for c in classes.split(",") if c.strip()),
        reshard_after_forward=_env_flag("FSDP_RESHARD_AFTER_FORWARD", True),
    )


@contextlib.contextmanager
def accelerate_without_fsdp() -> Iterator[None]:
    """Create the Accelerator inside this: it then runs plain multi-process (no FSDP plugin, which would
    wrap the model its own way, and on CPU silently falls back to DDP); the trainer shards with ``shard``."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def _fsdp_module_class():
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP units under ``module`` (itself included), root first; empty for an unsharded module."""
    FSDPModule = _fsdp_module_class()
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: torch.nn.Module) -> bool:
    return bool(fsdp_modules(module))


def shard(scorer: torch.nn.Module, settings: FSDPSettings, device: torch.device, *, trains: bool = True) -> torch.nn.Module:
    """Shard ``scorer`` (a ``CompletionScorer``) over all processes in place and return it. Build the
    optimizer after this: the parameters become DTensor shards. ``trains=False`` (the frozen KL reference,
    only ever run under ``no_grad``): every unit, the root included, is freed right after its forward, since
    no backward follows to free it; so between its forwards a process holds only its shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = scorer.model
    wanted = settings.wrap_classes or tuple(getattr(model, "_no_split_modules", None) or ())
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in wanted if name not in present]
    if not wanted or missing:
        candidates = sorted({name for name in present if name.endswith(("DecoderLayer", "Block"))})
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap: {','.join(missing) or '(none)'} is not a module class of "
            f"{type(model).__name__}; its layer classes: {', '.join(candidates)}"
        )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units = [m for m in model.modules() if type(m).__name__ in wanted]
    after_forward = settings.reshard_after_forward or not trains
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=after_forward)
    # a trained root keeps its parameters gathered from forward to backward (they are needed again at once)
    fully_shard(scorer, mesh=mesh, reshard_after_forward=not trains)
    # Make the scorer the root now: FSDP2 makes the first unit that runs forward the root, and the rollout
    # (which runs before any training forward) calls decoder layers directly, which would make one of
    # them a root and the scorer's first forward fail. (Private method: FSDP2 has no public lazy init.)
    scorer._get_fsdp_state()._lazy_init()
    scorer._reshard_after_forward_settings = {id(u): after_forward for u in units} | {id(scorer): not trains}
    return scorer


@contextlib.contextmanager
def gathered(module: torch.nn.Module) -> Iterator[None]:
    """Every FSDP unit of ``module`` all-gathered once for the block, freed after: the rollout and the
    evaluation call submodules (vision tower, decoder, ``lm_head``) directly and many times per sample;
    without this the root's parameters would stay shards there and every layer would be re-gathered at
    each decoded token. A no-op for an unsharded (or DDP-wrapped) module. Every process must enter it
    (all-gather and free are collective); inside, a process may run forwards alone (evaluation on rank 0):
    the layers' hooks find their parameters gathered and leave them so."""
    units = fsdp_modules(module)
    if not units:
        yield
        return
    after_forward = getattr(module, "_reshard_after_forward_settings", {})
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(after_forward.get(id(unit), False), recurse=False)


def sync_gradients(scorer: torch.nn.Module, now: bool) -> None:
    """Set before a micro-batch's forward: gradients are reduced over processes only in the backward of a
    step's last micro-batch (``now``); the earlier micro-batches accumulate locally. DDP: what ``no_sync``
    does, without nesting the micro-batch loop in a context. FSDP2: every unit's ``set_requires_gradient_sync``;
    a unit then keeps its unsharded gradient (the size of its parameters) from its first backward to the last
    micro-batch's: DDP's gradient memory during the update (between steps the gradients are shards again), for
    reductions that no longer grow with the number of micro-batches.

    What the last backward issues (``scripts/check_two_process.py --strategy fsdp`` counts it): one
    reduce-scatter per unit whose forward runs once per micro-batch (the root; every unit when rows are
    re-encoded), two per decoder layer under the tree-shared forward. That forward calls each layer several
    times (prompt, thoughts, answers); FSDP2 runs its post-backward once per call, the parameters' gradients
    arrive before the last of them, and the first one finds the gradient accumulated by the earlier
    micro-batches and reduces it early. Making that one reduction too needs FSDP2's private per-group state
    (a gradient-arrival hook that sets ``reduce_grads``), which could not be checked on NCCL here.
    One process: no wrapper, nothing to sync."""
    if hasattr(scorer, "require_backward_grad_sync"):  # a DDP wrapper
        scorer.require_backward_grad_sync = now
    elif isinstance(scorer, _fsdp_module_class()):  # the FSDP root: recurse sets every unit below it
        scorer.set_requires_gradient_sync(now, recurse=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Clip the gradients to a global 2-norm of ``max_norm`` and return the norm before clipping, as
    ``torch.nn.utils.clip_grad_norm_`` does, over sharded gradients: each process sums its shard's squares,
    the sums are added over processes (each element is on exactly one process), so the norm is the
    unsharded one."""
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    local = [_local(g) for g in grads]
    device = local[0].device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in local:
        squares += g.detach().double().pow(2).sum()
    dist.all_reduce(squares)
    total = float(squares.sqrt())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:  # the factor torch.nn.utils.clip_grad_norm_ applies
        for g in local:
            g.detach().mul_(scale)
    return total


def state_bytes(model: torch.nn.Module, optimizer, rank: int, reference: torch.nn.Module | None = None) -> dict[str, float]:
    """What this process holds of the model's parameters, gradients and optimizer state, in bytes:
    ``memory/rank<r>_{parameter,gradient,optimizer}_bytes`` (shards under FSDP, everything under DDP); with a
    frozen KL reference model of its own, its parameters too (``memory/rank<r>_reference_bytes``)."""

    def size(tensor: torch.Tensor) -> int:
        local = _local(tensor)
        return local.numel() * local.element_size()

    params = list(model.parameters())
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    optimizer_bytes = sum(size(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    held = {
        f"memory/rank{rank}_parameter_bytes": float(sum(size(p) for p in params)),
        f"memory/rank{rank}_gradient_bytes": float(sum(size(p.grad) for p in params if p.grad is not None)),
        f"memory/rank{rank}_optimizer_bytes": float(optimizer_bytes),
    }
    if reference is not None:
        held[f"memory/rank{rank}_reference_bytes"] = float(sum(size(p) for p in reference.parameters()))
    return held


def full_state_dict(state: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """``state`` (a module's state dict, or part of it) with every shard gathered (collective: every process
    calls it, with the same names); the full tensors are kept (on the CPU) only where ``keep``, the others get
    an empty dict."""
    from torch.distributed.tensor import DTensor

    full = {}
    for name, value in state.items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            full[name] = value.detach().cpu().clone()
    return full


def model_folder_state(policy) -> dict[str, torch.Tensor]:
    """The (sharded) tensors a checkpoint's model folder holds: the whole model's state dict, or with LoRA only
    the adapter's weights (``lora.adapter_state_names``): the frozen base is never gathered, so a checkpoint
    moves the adapter's few MB to rank 0, not the base model (~33 GB for a 7B model in fp32)."""
    if policy.adapter is None:
        return policy.model.state_dict()
    state = policy.adapter.state_dict()
    names = lora.adapter_state_names(policy.adapter, state)
    return {name: value for name, value in state.items() if name in names}


def write_model(policy, folder: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """The plain model folder (``lora.save_model``'s layout) from a gathered state dict: full weights, or
    the adapter (peft picks its weights out of the PeftModel's state dict); plus the processor."""
    folder = Path(folder)
    if policy.adapter is None:
        policy.model.save_pretrained(folder, state_dict=state_dict)
    else:
        policy.adapter.save_pretrained(folder, state_dict=state_dict, save_embedding_layers=False)
    policy.processor.save_pretrained(folder)


class ShardedCheckpointError(RuntimeError):
    """A sharded checkpoint's files did not write or read on some process; raised on every process alike."""


@contextlib.contextmanager
def _shard_failures(what: str) -> Iterator[None]:
    """dcp shares every rank's failure and raises ``CheckpointException`` on every rank alike, but that is a
    BaseException (past ``except Exception``, so past ``survive.together``) whose text is a traceback per rank:
    turn it into one ShardedCheckpointError naming each failing process and its error."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        failures = "; ".join(
            f"process {rank}: {type(failure).__name__}: {failure}" for rank, (failure, _) in sorted(error.failures.items())
        )
        raise ShardedCheckpointError(f"{what} failed on {failures}") from None


def save_checkpoint(
    scorer: torch.nn.Module, policy, optimizer, run_dir: Path, step: int, *, training_state: dict, keep: int, accelerator
) -> None:
    """Checkpoint ``step`` of a sharded run (collective: every process calls it): the model folder gathered on
    rank 0, the optimizer state sharded (each rank writes its part), the rest of the training state as in an
    unsharded checkpoint. Written next to the checkpoint and renamed into place like any checkpoint.

    The collectives (the weights' gather, ``dcp.save``) run outside ``survive.together`` and every file write
    inside one, so a write failing on one process (a full disk) stops every process at the next agreement
    instead of leaving the others in a collective it never joins. ``dcp.save`` shares each rank's write
    result itself: a shard that fails to write raises on every rank, inside its block. A pending stop signal
    waits for the save to finish (``act_on_signals=False``): the checkpoint is what the signal asks for."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    is_main = accelerator.is_main_process
    optimizer = getattr(optimizer, "optimizer", optimizer)
    weights = full_state_dict(model_folder_state(policy), keep=is_main)
    if is_main:  # the others keep nothing
        log.info("checkpoint %d: gathered %d weight elements for the model folder", step, sum(w.numel() for w in weights.values()))
    staging = ckpt.checkpoint_dir(run_dir, step).with_name(f"step-{step:06d}.optimizer.tmp")
    with survive.together(accelerator, act_on_signals=False):
        if is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
    optimizer_state = {"optimizer": get_optimizer_state_dict(scorer, optimizer)}
    with survive.together(accelerator, act_on_signals=False), _shard_failures(f"writing {staging}"):
        dcp.save(optimizer_state, checkpoint_id=str(staging))
    with survive.together(accelerator, act_on_signals=False):
        if is_main:
            ckpt.save_checkpoint(
                run_dir,
                step,
                write_model=lambda folder: write_model(policy, folder, weights),
                training_state={**training_state, "optimizer": SHARDED_OPTIMIZER},
                keep=keep,
                write_extra=lambda folder: os.replace(staging, folder / OPTIMIZER_FOLDER),
            )


def load_optimizer(scorer: torch.nn.Module, optimizer, checkpoint: Path) -> None:
    """The sharded optimizer state of ``checkpoint`` into ``optimizer`` (collective), resharded to this run's
    processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)
    folder = Path(checkpoint) / OPTIMIZER_FOLDER
    if not folder.is_dir():
        raise FileNotFoundError(f"{checkpoint} is a sharded checkpoint without its {OPTIMIZER_FOLDER}/ folder")
    state = {"optimizer": get_optimizer_state_dict(scorer, optimizer)}
    with _shard_failures(f"reading {folder}"):
        dcp.load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(scorer, optimizer, state["optimizer"])
