"""What keeps a run's checkpoints worth resuming: SIGTERM saves like Ctrl-C, non-finite numbers stop the
run before they reach a checkpoint, and a stop on one process stops every process at the same point.
``train()`` calls these in one line each (see docs/ARCHITECTURE.md, "Runs that survive").

Several processes: an error raised on one process alone (a non-finite reward, a reward that must stop the
run, an unreadable data file) would leave the others waiting in their next collective until a watchdog
killed them, with nothing saved. So the work between two collectives runs inside ``together(accelerator)``:
on leaving it every process learns whether any process failed or received a stop signal, and if one did,
every process raises, naming the process and its error. Signals (SIGTERM, and Ctrl-C's SIGINT) are recorded
and acted on there, not raised where they land, since a process stopped mid-collective would hang the
others. An error that left every process at the same point is marked ``stopped_together``: the way out of
``train()`` may then checkpoint collectively (FSDP) as one process does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time

import torch

log = logging.getLogger("vlm_grpo_ma.survive")


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``kill`` and job schedulers send), raised where the run is so that it takes the same path
    as Ctrl-C: the last completed step is checkpointed, then the process exits with 143 (128 + SIGTERM)."""

    exit_code = 128 + signal.SIGTERM


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) received by one process of several, raised on every process at the same point."""

    exit_code = 128 + signal.SIGINT


class NonFiniteError(RuntimeError):
    """A NaN or infinity in a step's rewards, advantages, loss, gradient norm, learning rate or weights."""


class StoppedByAnotherProcess(RuntimeError):
    """Raised on every process but the failing one when one process's error stops the run; the message names
    that process and its error."""


_pending_signal: list[int] = []  # several processes: stop signals received, acted on by ``together``
_first_received: dict[int, float] = {}  # signal -> time.monotonic() when it was first received
# Several processes: the same signal again within this many seconds is the same request. A scheduler that
# signals every process of a job while the launcher forwards its own copy delivers each signal twice within
# milliseconds; raising on the second would stop each process at a different point.
REPEAT_GRACE_S = 10.0


def raise_on_sigterm(num_processes: int = 1):
    """Until the returned ``restore()`` is called, SIGTERM raises ``Terminated`` in the main thread. A second
    SIGTERM while the first is being handled is ignored, so the checkpoint being saved is finished (a
    scheduler that will not wait sends SIGKILL; checkpoints are written atomically). Does nothing outside the
    main thread, where Python cannot install handlers.

    With several processes SIGTERM and SIGINT are recorded instead, and every process stops at the next
    ``together`` (``Terminated`` or ``Interrupted`` there); the same signal again more than ``REPEAT_GRACE_S``
    seconds later raises at once (the way out when a process is stuck); within it, it is ignored."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _pending_signal.clear()
    _first_received.clear()
    kinds = (signal.SIGTERM,) if num_processes == 1 else (signal.SIGTERM, signal.SIGINT)
    previous = {kind: signal.getsignal(kind) for kind in kinds}

    def handler(signum, frame):
        if num_processes > 1 and signum not in _pending_signal:
            _pending_signal.append(signum)
            _first_received[signum] = time.monotonic()
            log.warning("received %s: every process stops after its current phase", signal.Signals(signum).name)
            return
        if num_processes > 1 and time.monotonic() - _first_received[signum] < REPEAT_GRACE_S:
            return  # the same request delivered twice (see REPEAT_GRACE_S)
        signal.signal(signum, signal.SIG_IGN)
        raise _signal_error(signum, f"received signal {signal.Signals(signum).name}")

    for kind in kinds:
        signal.signal(kind, handler)

    def restore() -> None:
        _pending_signal.clear()
        for kind, handler_before in previous.items():
            signal.signal(kind, handler_before if handler_before is not None else signal.SIG_DFL)

    return restore


def _signal_error(signum: int, message: str) -> KeyboardInterrupt:
    return Terminated(message) if signum == signal.SIGTERM else Interrupted(message)


@contextlib.contextmanager
def together(accelerator, *, act_on_signals: bool = True):
    """Run a block that holds no collective; on leaving it, every process stops if any process raised in it
    or has a stop signal pending (see the module's docstring). One process: errors pass through as they are.
    ``act_on_signals=False`` leaves a pending signal for the next block: where the weights have changed and the
    step is not complete, stopping would lose every step since the last checkpoint."""
    error = None
    try:
        yield
    except Exception as raised:  # noqa: BLE001 - every error is shared with the other processes, then re-raised
        error = raised
    agree(accelerator, error, act_on_signals=act_on_signals)


def agree(accelerator, error: Exception | None, *, act_on_signals: bool = True) -> None:
    """Every process calls this at the same point. Raises on every process when any process brings an error
    (the failing process re-raises its own; the others ``StoppedByAnotherProcess`` with its message) or, with
    ``act_on_signals``, has a stop signal pending (``Terminated`` / ``Interrupted`` everywhere; each process
    logs which process received it). Each raised error is marked ``stopped_together``."""
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    state = 2 if error is not None else (1 if _pending_signal and act_on_signals else 0)
    states = accelerator.gather(torch.tensor([state, _pending_signal[0] if _pending_signal else 0], device=accelerator.device))
    states = states.view(-1, 2).tolist()
    if max(s for s, _ in states) == 0:
        return
    from accelerate.utils import gather_object

    messages = gather_object([None if error is None else f"{type(error).__name__}: {error}"])
    failed = [rank for rank, (s, _) in enumerate(states) if s == 2]
    if failed:  # not logged: the errors raised say it, and the CLI prints it once (run/cli.py, say_error)
        first = failed[0]
        message = f"process {first} stopped the run: {messages[first]}"
        stop = error if accelerator.process_index == first else StoppedByAnotherProcess(message)
    else:
        first, signum = next((rank, sig) for rank, (s, sig) in enumerate(states) if s == 1)
        message = f"process {first} received signal {signal.Signals(signum).name}"
        log.error("stopping every process: %s", message)
        stop = _signal_error(signum, message)
    stop.stopped_together = True
    if stop is error:
        raise error
    raise stop from error


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
    # each process's own values (FSDP: its shards; reading a sharded whole would be a collective)
    trainable = [(name, p.to_local() if hasattr(p, "to_local") else p) for name, p in model.named_parameters() if p.requires_grad]
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
