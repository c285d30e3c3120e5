"""Atomic checkpoints and exact resume.

A checkpoint is a folder ``checkpoints/step-NNNNNN`` holding the model as a loadable Hugging Face folder
(``model/``: weights, or a LoRA adapter naming its base model, + processor, so a checkpoint is also a
model path for evaluation) and ``state.pt``
(optimizer, scheduler, RNG states, data position, step, metric history). It is written to a temporary
folder and renamed into place, so a crash mid-write never leaves a half checkpoint that resume would pick.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import torch

_STEP_DIR = re.compile(r"^step-(\d{6})$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def checkpoint_step(folder: Path) -> int:
    return int(_STEP_DIR.match(Path(folder).name).group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "state.pt").is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the RNG states of ``rng_state``. The saved CUDA list holds one state per GPU visible when the
    checkpoint was written; a resume may see fewer (or more) GPUs, so only the states of devices that exist now
    are restored (``cuda_states_to_restore``). Sampling draws from its own seeded generators, so this restores
    only what else may draw (dropout, if a model has it)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in cuda_states_to_restore(state["cuda"], torch.cuda.device_count()):
            torch.cuda.set_rng_state(cuda_state, device)


def cuda_states_to_restore(saved: list, visible_devices: int) -> list[tuple[int, torch.Tensor]]:
    """``(device index, state)`` for the saved CUDA RNG states whose device is visible now: the first
    ``min(len(saved), visible_devices)``. A device with no saved state keeps its own seed."""
    return list(enumerate(saved[:visible_devices]))


def save_checkpoint(run_dir: Path, step: int, *, write_model, training_state: dict, keep: int, write_extra=None) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep``. ``write_model(folder)`` writes
    a folder ``load_policy`` loads (full weights, or a LoRA adapter naming its base, plus the processor);
    ``write_extra(checkpoint_folder)``, if given, adds more (the sharded optimizer state of an FSDP run)."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_model(tmp / "model")
    if write_extra is not None:
        write_extra(tmp)
    torch.save({**training_state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    # Only checkpoints up to this one count: one of a later step is left from before a resume that passed it
    # over (it does not load), and counting it as the newest would delete this one and the good one before it.
    for old in [c for c in list_checkpoints(run_dir) if checkpoint_step(c) <= step][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_training_state(path: Path) -> dict:
    return torch.load(Path(path) / "state.pt", weights_only=False)


class CheckpointLoadError(Exception):
    """A file of a checkpoint that does not load; the message names it."""


def newest_that_loads(checkpoints: list[Path], load, passed_over) -> tuple[Path | None, object, list[str]]:
    """The newest of ``checkpoints`` (oldest first) whose ``load(checkpoint)`` raises no CheckpointLoadError,
    what it returned, and the errors of the newer ones passed over (``passed_over(error)`` is called on each);
    ``(None, None, errors)`` when none loads."""
    failures = []
    for checkpoint in reversed(checkpoints):
        try:
            return checkpoint, load(checkpoint), failures
        except CheckpointLoadError as error:
            failures.append(str(error))
            passed_over(error)
    return None, None, failures


def load_resumable_state(path: Path) -> dict:
    """The training state of checkpoint ``path``, once its model's weight files are found whole: safetensors
    reads only a file's header, which gives every tensor's byte range, so a file cut short fails here (in
    milliseconds) rather than when the model loads. CheckpointLoadError names the file that does not load."""
    file = Path(path) / "state.pt"
    try:
        state = load_training_state(path)
    except Exception as error:  # torch.load raises RuntimeError, EOFError, UnpicklingError ... on a cut file
        raise CheckpointLoadError(f"{file} does not load ({type(error).__name__}: {error})") from error
    check_weight_files(Path(path) / "model")
    return state


def check_weight_files(model_folder: Path) -> None:
    """CheckpointLoadError naming the first ``*.safetensors`` file of ``model_folder`` whose header does not
    read (``loading.unreadable_weights``, the check every model folder gets): a file cut short (a full disk, a
    killed copy) fails here in milliseconds, not in the model's load."""
    from vlm_grpo_ma.model.loading import unreadable_weights

    problem = unreadable_weights(Path(model_folder))
    if problem is not None:
        raise CheckpointLoadError(problem)
