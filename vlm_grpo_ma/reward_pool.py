"""Reward worker processes: every task reward runs in a worker process, under a deadline.

A reward is arbitrary Python on model output: a regex that backtracks, sympy on ``\\Gamma(\\Gamma(\\Gamma(5)))``,
a third-party reward that loops. A thread cannot be stopped, and a signal timer (SIGALRM) reaches only the main
thread and cannot interrupt one long C-level operation (a big-integer product). A process can always be killed.
So ``RewardPool.run`` sends each job (the reward function, the completion, the sample) to an idle worker; a job
that has not answered ``timeout_s`` seconds after the worker started it is scored by the caller as a timeout and
its worker is killed (SIGKILL) and replaced. A worker that dies (a crash, ``sys.exit`` in a reward) scores its
job as an error and is replaced too. Each job is independent, so the results do not depend on the number of
workers or on the order in which they finish.

Workers are started with the ``forkserver`` method: the fork server is a fresh interpreter that imports this
module and the built-in task modules once, and each worker is a cheap fork of it (a replacement takes
milliseconds). Forking the trainer itself would copy a process that runs torch and CUDA threads. Functions are
pickled by reference (module and name), so a worker imports the reward's module when it receives the first job
of that task: before the job of a task from ``data.task_modules`` the worker imports the modules that
``registry.import_task_modules`` was given in the parent (``user_task_*`` modules exist only after that).
The clock of a job starts when the worker has received it, so a first import (a task module that imports torch)
is not counted against the deadline; receiving has its own, longer limit (``LOAD_LIMIT_S``).

A reward that cannot be pickled (a lambda, a closure) cannot be sent to a worker: it runs in a daemon thread of
the caller under the same deadline, and is scored 0 and counted when it passes it, but that thread cannot be
stopped (a warning says so once per task).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import connection, get_context
from typing import Any

log = logging.getLogger(__name__)

# The default deadline of one reward call. The slowest legitimate reward is code's: one sandboxed run of up to
# 10 s wall time plus start-up; the others take milliseconds (math-verify up to ~0.5 s on screened input).
DEFAULT_TIMEOUT_S = 30.0
# How long a worker may take to receive a job (unpickling it may import the task's module, e.g. torch).
LOAD_LIMIT_S = 120.0


class RewardTimeout(Exception):
    """A reward that did not finish within its deadline (scored 0, counted as ``reward_timeouts``)."""


class RewardError(Exception):
    """A reward that raised (its repr is the message) or whose worker died (scored 0, ``reward_errors``)."""


Job = tuple[Callable[..., Any], Any, Any]  # (reward function, completion, sample)
Outcome = tuple[dict[str, Any] | None, Exception | None]  # (parts, None) or (None, RewardTimeout/RewardError)


# ---------------------------------------------------------------------------------------------- worker side


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent (the fork server, which exits with the trainer) dies, so that
    no worker stuck in a reward outlives the run."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(conn, sys_path: list[str]) -> None:
    sys.path[:] = sys_path
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which then stops the workers
    from vlm_grpo_ma.registry import import_task_modules, load_builtin_tasks

    load_builtin_tasks()
    imported: set[str] = set()
    while True:
        try:
            modules, payload = conn.recv()
        except (EOFError, OSError):
            return
        try:
            for module in modules:
                if module not in imported:
                    import_task_modules([module])
                    imported.add(module)
            reward, completion, sample = pickle.loads(payload)
        except BaseException as error:  # noqa: BLE001 - reported to the parent as the job's error
            conn.send(("error", f"loading the reward job failed: {error!r}"))
            continue
        conn.send(("started", None))
        try:
            parts = dict(reward(completion, sample))
        except BaseException as error:  # noqa: BLE001 - SystemExit in a reward must not end the worker silently
            conn.send(("error", repr(error)))
            continue
        try:
            conn.send(("done", parts))
        except Exception as error:  # noqa: BLE001 - parts that do not pickle
            conn.send(("error", f"the reward parts could not be sent: {error!r}"))


# ---------------------------------------------------------------------------------------------- parent side

_CONTEXT = None


def _context():
    """The forkserver context, with this module and the built-in tasks preloaded in the fork server."""
    global _CONTEXT
    if _CONTEXT is None:
        import pkgutil

        import tasks

        _CONTEXT = get_context("forkserver")
        builtin = [f"tasks.{info.name}" for info in pkgutil.iter_modules(tasks.__path__) if not info.name.startswith("_")]
        _CONTEXT.set_forkserver_preload([__name__, *builtin])
    return _CONTEXT


@dataclass
class _Worker:
    process: Any
    conn: Any
    job: int | None = None
    sent_at: float = 0.0
    started_at: float | None = None

    @classmethod
    def start(cls) -> _Worker:
        context = _context()
        ours, theirs = context.Pipe()
        process = context.Process(target=_worker_main, args=(theirs, list(sys.path)), daemon=True, name="reward-worker")
        process.start()
        theirs.close()  # so that a dead worker reads as EOF on our end
        return cls(process, ours)

    def deadline(self, timeout_s: float) -> float:
        if self.started_at is None:
            return self.sent_at + max(LOAD_LIMIT_S, timeout_s)
        return self.started_at + timeout_s

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """Worker processes that score reward jobs under a deadline (see the module docstring). Workers are started
    on demand, up to the ``workers`` a call asks for, and kept for the next call."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._warned_local: set[str] = set()

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                worker.stop()
            self._workers = []

    def run(self, jobs: Sequence[Job], *, workers: int, timeout_s: float) -> list[Outcome]:
        """One outcome per job, in order: ``(parts, None)``, or ``(None, RewardTimeout)`` for a job past
        ``timeout_s``, or ``(None, RewardError)`` for a job that raised or killed its worker."""
        with self._lock:
            return self._run(jobs, max(1, workers), timeout_s)

    def _run(self, jobs: Sequence[Job], workers: int, timeout_s: float) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(jobs)
        payloads: dict[int, bytes] = {}
        local: list[int] = []
        for index, job in enumerate(jobs):
            try:
                payloads[index] = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - a lambda or closure reward: run here instead
                local.append(index)
        queue = deque(sorted(payloads))
        modules = _imported_task_modules()
        while len(self._workers) < min(workers, len(queue)):
            self._workers.append(_Worker.start())
        idle = deque(self._workers[: min(workers, len(self._workers))])
        busy: dict[Any, _Worker] = {}
        while queue or busy:
            while idle and queue:
                worker, index = idle.popleft(), queue.popleft()
                try:
                    worker.conn.send((modules, payloads[index]))
                except (OSError, ValueError):  # the worker is gone: replace it and retry the job
                    self._replace(worker)
                    idle.append(self._workers[-1])
                    queue.appendleft(index)
                    continue
                worker.job, worker.sent_at, worker.started_at = index, time.monotonic(), None
                busy[worker.conn] = worker
            next_deadline = min(worker.deadline(timeout_s) for worker in busy.values())
            for conn in connection.wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                worker = busy[conn]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    worker.process.join(timeout=5)
                    outcomes[worker.job] = (None, RewardError(f"the reward worker died (exit code {worker.process.exitcode})"))
                    del busy[conn]
                    idle.append(self._replace(worker))
                    continue
                if kind == "started":
                    worker.started_at = time.monotonic()
                    continue
                outcomes[worker.job] = (value, None) if kind == "done" else (None, RewardError(value))
                del busy[conn]
                idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if now >= worker.deadline(timeout_s):
                    what = "ran" if worker.started_at is not None else "was not received within"
                    outcomes[worker.job] = (None, RewardTimeout(f"the reward {what} past its {timeout_s:g} s deadline"))
                    del busy[conn]
                    idle.append(self._replace(worker))
        for index in local:
            outcomes[index] = self._run_local(jobs[index], timeout_s)
        return outcomes  # type: ignore[return-value]

    def _replace(self, worker: _Worker) -> _Worker:
        """Kill ``worker`` (it may be stuck in a reward) and put a fresh one in its place."""
        worker.stop()
        fresh = _Worker.start()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def _run_local(self, job: Job, timeout_s: float) -> Outcome:
        reward, completion, sample = job
        name = getattr(reward, "__qualname__", repr(reward))
        if name not in self._warned_local:
            self._warned_local.add(name)
            log.warning(
                "reward %s cannot be pickled (a lambda or closure?), so it runs in a thread of this process: past "
                "its deadline it scores 0, but the thread cannot be stopped; define it at module level", name
            )
        box: list[Outcome] = []

        def call() -> None:
            try:
                box.append((dict(reward(completion, sample)), None))
            except BaseException as error:  # noqa: BLE001
                box.append((None, RewardError(repr(error))))

        thread = threading.Thread(target=call, daemon=True, name="reward-local")
        thread.start()
        thread.join(timeout_s)
        return box[0] if box else (None, RewardTimeout(f"the reward ran past its {timeout_s:g} s deadline"))


def _imported_task_modules() -> tuple[str, ...]:
    from vlm_grpo_ma.registry import imported_task_modules

    return imported_task_modules()


_SHARED: RewardPool | None = None
_SHARED_PID: int | None = None


def shared_pool() -> RewardPool:
    """The process's reward pool (created on first use, closed at exit; a forked child gets its own)."""
    global _SHARED, _SHARED_PID
    if _SHARED is None or _SHARED_PID != os.getpid():
        _SHARED, _SHARED_PID = RewardPool(), os.getpid()
    return _SHARED


@atexit.register
def _close_shared() -> None:
    if _SHARED is not None and _SHARED_PID == os.getpid():
        _SHARED.close()
