"""Reward worker processes: every task reward runs in a worker process, under a deadline.

A reward is arbitrary Python on model output: a regex that backtracks, sympy on ``\\Gamma(\\Gamma(\\Gamma(5)))``,
a third-party reward that loops. A thread cannot be stopped, and a signal timer (SIGALRM) reaches only the main
thread and cannot interrupt one long C-level operation (a big-integer product). A process can always be killed.
So ``RewardPool.run`` sends each job (the reward function, the completion, the sample) to an idle worker; a job
that has not answered ``timeout_s`` seconds after the worker started it is scored by the caller as a timeout and
its worker is killed (SIGKILL) and replaced. A worker that dies (a crash, ``sys.exit`` in a reward) scores its
job as an error and is replaced too. Each job is independent, so the results do not depend on the number of
workers or on the order in which they finish.

Workers are fresh interpreters (``python -c``, given the parent's ``sys.path``) that talk to the parent over a
socket pair. Not ``fork``: forking the trainer would copy a process that runs torch and CUDA threads. Not
``multiprocessing``'s spawn or forkserver either: their children re-import the parent's ``__main__`` (the
trainer module, torch and all, or an unguarded user script). A worker imports the built-in tasks once at
start (about half a second, in parallel with the other workers, and not counted against any deadline).
Functions are pickled by reference (module and name), so a worker imports the reward's module when it receives
the first job of that task: before each job it imports the modules that ``registry.import_task_modules`` was
given in the parent (``user_task_*`` modules from ``data.task_modules`` exist only after that). The clock of a
job starts when the worker has received it, so a first import (a task module that imports torch) is not counted
against the deadline; receiving has its own, longer limit (``LOAD_LIMIT_S``). A worker exits when the parent
closes its end of the socket, and a watchdog thread ends it when the parent process is gone (a trainer killed
with SIGKILL); ``atexit`` kills the workers of a parent that exits normally.

A reward that cannot be pickled (a lambda, a closure) cannot be sent to a worker: it runs in a daemon thread of
the caller under the same deadline, and is scored 0 and counted when it passes it, but that thread cannot be
stopped (a warning says so once per task).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import connection
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


def _watch_parent(parent: int) -> None:
    """End this worker when its parent is gone (re-parented: ``getppid`` changes), checked every second. A
    reward stuck in one long C call holds the GIL and delays this check until the call returns."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_entry(fd: int, parent: int) -> None:
    """The worker process's main: serve jobs on the socket ``fd`` until the parent closes it."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="parent-watch").start()
    _worker_main(connection.Connection(fd))


_WORKER_CODE = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from vlm_grpo_ma.task_api.reward_pool import _worker_entry; _worker_entry(int(sys.argv[2]), int(sys.argv[3]))"
)


def _worker_main(conn) -> None:
    """Serve chunks of jobs: receive ``(modules, [pickled job, ...])``, import the modules and unpickle every
    job, answer ``("started", None)``, then one ``("done", parts)`` or ``("error", message)`` per job, in order.
    Loading comes before "started" so that only the reward calls run against the deadline."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which then stops the workers
    from vlm_grpo_ma.task_api.registry import import_task_modules, load_builtin_tasks

    load_builtin_tasks()
    imported: set[str] = set()
    while True:
        try:
            modules, payloads = conn.recv()
        except (EOFError, OSError):
            return
        jobs: list[tuple | str] = []
        for payload in payloads:
            try:
                for module in modules:
                    if module not in imported:
                        import_task_modules([module])
                        imported.add(module)
                jobs.append(pickle.loads(payload))
            except BaseException as error:  # noqa: BLE001 - reported to the parent as the job's error
                jobs.append(f"loading the reward job failed: {error!r}")
        conn.send(("started", None))
        for job in jobs:
            if isinstance(job, str):
                conn.send(("error", job))
                continue
            reward, completion, sample = job
            try:
                parts = dict(reward(completion, sample))
            except BaseException as error:  # noqa: BLE001 - even SystemExit: the job's error, not the worker's end
                conn.send(("error", repr(error)))
                continue
            try:
                conn.send(("done", parts))
            except Exception as error:  # noqa: BLE001 - parts that do not pickle
                conn.send(("error", f"the reward parts could not be sent: {error!r}"))


# ---------------------------------------------------------------------------------------------- parent side

@dataclass
class _Worker:
    """One worker process, and the chunk of jobs it is working through (``chunk[position]`` runs now)."""

    process: Any
    conn: Any
    chunk: list[int] = field(default_factory=list)
    position: int = 0
    sent_at: float = 0.0
    started: bool = False
    last_event: float = 0.0  # when it started the chunk or finished the previous job: the current job's start

    @classmethod
    def start(cls) -> _Worker:
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, json.dumps(sys.path), str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()  # the worker holds its own copy; a dead worker then reads as EOF on our end
        return cls(process, connection.Connection(ours.detach()))

    def deadline(self, timeout_s: float) -> float:
        if not self.started:
            return self.sent_at + max(LOAD_LIMIT_S, timeout_s)
        return self.last_event + timeout_s

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
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
            busy: dict[Any, _Worker] = {}
            try:
                return self._run(jobs, max(1, workers), timeout_s, busy)
            except BaseException:
                # Interrupted (Ctrl-C, SIGTERM, an error): the busy workers are still working through this
                # call's jobs, and the next call would read their answers as its own (a notebook that resumes
                # training after Ctrl-C trained on another step's rewards). They are killed, not drained: a
                # reward may never answer; the next call starts fresh ones.
                self._discard(list(busy.values()))
                raise

    def _discard(self, workers: list[_Worker]) -> None:
        for worker in workers:
            worker.stop()
            self._workers.remove(worker)

    def _run(self, jobs: Sequence[Job], workers: int, timeout_s: float, busy: dict[Any, _Worker]) -> list[Outcome]:
        """``run``'s work; ``busy`` (empty, filled here) holds the workers that owe an answer to this call."""
        outcomes: list[Outcome | None] = [None] * len(jobs)
        payloads: dict[int, bytes] = {}
        local: list[int] = []
        for index, job in enumerate(jobs):
            try:
                payloads[index] = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - a lambda or closure reward: run here instead
                local.append(index)
        queue = deque(sorted(payloads))
        # Jobs go out in chunks (fewer messages: ~4 chunks per worker), each job still under its own deadline.
        chunk_size = max(1, -(-len(queue) // (4 * workers)))
        modules = _imported_task_modules()
        while len(self._workers) < min(workers, len(queue)):
            self._workers.append(_Worker.start())
        idle = deque(self._workers[: min(workers, len(self._workers))])

        def finish(worker: _Worker, outcome: Outcome, *, requeue_rest: bool) -> None:
            """Record the outcome of the worker's current job; on a dead or killed worker, put the rest of its
            chunk back at the front of the queue."""
            outcomes[worker.chunk[worker.position]] = outcome
            worker.position += 1
            worker.last_event = time.monotonic()
            if requeue_rest:
                queue.extendleft(reversed(worker.chunk[worker.position :]))
                worker.chunk = worker.chunk[: worker.position]

        while queue or busy:
            while idle and queue:
                worker = idle.popleft()
                chunk = [queue.popleft() for _ in range(min(chunk_size, len(queue)))]
                busy[worker.conn] = worker  # before sending: an interrupted send leaves half a message
                try:
                    worker.conn.send((modules, [payloads[index] for index in chunk]))
                except (OSError, ValueError):  # the worker is gone: replace it and send the chunk again
                    del busy[worker.conn]
                    queue.extendleft(reversed(chunk))
                    idle.append(self._replace(worker))
                    continue
                worker.chunk, worker.position, worker.started = chunk, 0, False
                worker.sent_at = time.monotonic()
            next_deadline = min(worker.deadline(timeout_s) for worker in busy.values())
            for conn in connection.wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                worker = busy[conn]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    exit_code = worker.process.wait()
                    died = RewardError(f"the reward worker died (exit code {exit_code})")
                    if worker.started:
                        finish(worker, (None, died), requeue_rest=True)
                    else:  # it died loading the chunk: no job of it is to blame more than another
                        for index in worker.chunk:
                            outcomes[index] = (None, died)
                    del busy[conn]
                    idle.append(self._replace(worker))
                    continue
                if kind == "started":
                    worker.started, worker.last_event = True, time.monotonic()
                    continue
                finish(worker, (value, None) if kind == "done" else (None, RewardError(value)), requeue_rest=False)
                if worker.position == len(worker.chunk):
                    del busy[conn]
                    idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if now < worker.deadline(timeout_s):
                    continue
                if worker.started:
                    timeout = RewardTimeout(f"the reward ran past its {timeout_s:g} s deadline")
                    finish(worker, (None, timeout), requeue_rest=True)
                else:
                    timeout = RewardTimeout(f"the reward job was not received within {LOAD_LIMIT_S:g} s")
                    for index in worker.chunk:
                        outcomes[index] = (None, timeout)
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
    from vlm_grpo_ma.task_api.registry import imported_task_modules

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
