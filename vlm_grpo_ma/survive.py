"""What keeps a run's checkpoints worth resuming: SIGTERM saves like Ctrl-C, and non-finite numbers stop the
run before they reach a checkpoint. ``train()`` calls these in one line each (see docs/ARCHITECTURE.md,
"Runs that survive")."""

from __future__ import annotations

import math
import signal
import threading

import torch


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``kill`` and job schedulers send), raised where the run is so that it takes the same path
    as Ctrl-C: the last completed step is checkpointed, then the process exits with 143 (128 + SIGTERM)."""

    exit_code = 128 + signal.SIGTERM


class NonFiniteError(RuntimeError):
    """A NaN or infinity in a step's rewards, advantages, loss, gradient norm, learning rate or weights."""


def raise_on_sigterm():
    """Until the returned ``restore()`` is called, SIGTERM raises ``Terminated`` in the main thread. A second
    SIGTERM while the first is being handled is ignored, so the checkpoint being saved is finished (a
    scheduler that will not wait sends SIGKILL; checkpoints are written atomically). Does nothing outside the
    main thread, where Python cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(f"received signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    return restore


def _is_finite(value) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(value)


def check_inputs_finite(step: int, rewards, advantages, learning_rate) -> None:
    """Before the update of training step ``step``: raise NonFiniteError naming the first non-finite one of
    the rewards (totals; a NaN part is "not applicable"), the thought and answer advantages and the learning
    rate. The update itself checks its loss and gradient norm (``check_update_finite``), and the weights are
    checked after it (``check_weights_finite``)."""
    thought_adv, answer_adv = advantages
    quantities = {
        "reward": rewards,
        "advantage/thought": thought_adv,
        "advantage/answer": answer_adv,
        "train/learning_rate": learning_rate,
    }
    for name, value in quantities.items():
        if not _is_finite(value):
            raise NonFiniteError(_message(step, name, value))


def check_weights_finite(step: int, model: torch.nn.Module) -> None:
    """After the optimiser step of training step ``step`` and before the step counts as completed: raise
    NonFiniteError naming the first trainable weight that is not finite, so the crash path keeps the last
    checkpoint as it is and a checkpoint never holds non-finite weights."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if trainable and not bool(torch.stack([torch.isfinite(p).all() for _, p in trainable]).all()):
        name = next(name for name, p in trainable if not bool(torch.isfinite(p).all()))
        raise NonFiniteError(_message(step, f"weight {name}", None))


def check_update_finite(loss: float, grad_norm: float) -> None:
    """Before an optimiser step: raise NonFiniteError when the step's loss or gradient norm is NaN or infinite,
    so the weights stay those of the last completed step (which the crash path then checkpoints)."""
    for name, value in (("train/loss", loss), ("train/grad_norm", grad_norm)):
        if not math.isfinite(value):
            raise NonFiniteError(
                f"{name} = {value} is not finite (NaN or infinity) before the optimiser step; the weights are left "
                "as the last completed step made them. Check train.learning_rate, data.reward_weights and the task's reward."
            )


def _message(step: int, name: str, value) -> str:
    shown = "" if value is None or isinstance(value, torch.Tensor) else f" = {value}"
    return (
        f"step {step}: {name}{shown} is not finite (NaN or infinity); stopping without checkpointing this step "
        "(the last checkpoint is kept). Check train.learning_rate, data.reward_weights and the task's reward."
    )
