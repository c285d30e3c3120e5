"""Run untrusted Python (a model's program) against trusted tests, in processes that exchange only data.

``run_tests(program, steps, ...)`` starts ``python -I -S -B tasks/_sandbox.py --judge`` in a fresh session
with a scrubbed environment and returns a ``RunResult``: how many counted test steps passed and a
``status`` (one of STATUSES). Three processes take part:

  * the judge (trusted): runs the tests. It starts the program's process, and only then reads the tests,
    so they never exist in the program's memory. Each call a test makes to a program function goes to the
    program's process as a request (the function's name and its arguments as plain data) and comes back as
    plain data: None, bool, int, float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict
    and collections' deque, OrderedDict, Counter and defaultdict, checked by exact type and rebuilt by the
    judge. Anything else (an object whose ``__eq__`` always
    says True, a subclass of int, a generator) fails the test. The tests run with the judge's own builtins
    and modules, so a program cannot shadow ``set``/``sorted``/``abs``, patch ``math``, walk frames into
    the tests or swap ``candidate``: none of that is in its process. The judge alone writes results to the
    trainer, on a pipe tagged with a per-run nonce the program never sees.
  * a tiny init (pid 1 of the sandbox's pid namespace, when there is one) that waits for the program and
    passes its exit status to the judge;
  * the program's process (untrusted): it executes the program, then answers call requests.

Layers of the program's process, strongest first. Each is applied when the machine allows it and recorded
in ``RunResult.layers``; ``default_isolation()`` probes once per process which layers work here.

Kernel-enforced (the namespaces with ``Isolation.namespaces``, as root or in an unprivileged user namespace
where the kernel allows one; ``uid:N`` with ``Isolation.unprivileged_uid``, as root; the rest always). See
docs/SANDBOX.md for what each mode guarantees.
  * ``userns``        (non-root only) a user namespace in which the judge is root, making the rest possible;
  * ``pidns``         a new pid namespace: the program sees only the sandbox's processes (its parent is the
                      init above), so it cannot signal the judge or the trainer (``pidfd_open(getppid())``
                      reaches the init, whose death ends the run), and killing the init kills everything;
  * ``netns``         a new, empty network namespace (only a downed loopback);
  * ``private_root``  a private mount namespace whose root is an empty, read-only tmpfs holding only the
                      interpreter's standard library (its site-packages hidden), /usr/lib (system
                      python3 packages hidden) for the C extensions' shared libraries, /dev/null, /dev/zero,
                      /dev/urandom and the working directory. No home, no /work, no datasets, no /tmp, no
                      /proc, no other site-packages exist there, and no path can reach a memfd;
  * ``tmpfs_workdir`` the working directory is a private tmpfs of ``Limits.disk_mb`` (nosuid, nodev,
                      noexec: no native module can be written and loaded): the program cannot fill the
                      host's disk, and whatever it leaves disappears with the namespace;
  * ``uid:N``         (root only) the program drops to a fresh unprivileged uid/gid N (random, unused, no
                      groups): ``RLIMIT_NPROC`` counts this uid only, so with the default
                      ``Limits.processes = 0`` no fork, thread or exec succeeds, and the end-of-run sweep kills
                      every process of that uid. Without root, every capability of the user namespace is
                      dropped instead (``no_caps``);
  * ``rlimits``       CPU seconds, address space, file size, open files, no core dumps, ``RLIMIT_NPROC``;
  * ``no_new_privs``  set-uid binaries grant nothing;
  * ``seccomp``       (any user, with or without namespaces) the system calls of _SECCOMP_REFUSED fail with
                      EPERM: no signal to any other process, no pidfd, no ptrace or reading of another
                      process's memory, no memfd (native code from memory), no mount or namespace change.
Parent-enforced (always): a wall-clock limit; a byte cap on stdout+stderr (the run is killed when it is
exceeded: "output_limit"); at the end the process group is killed and /proc is swept for survivors (same
uid, session or process group) before the working directory on the host is deleted (iteratively, so any
depth of nested folders goes). Judge-enforced (always): the judge's guard does the same when the trainer's
side is gone (its lifeline pipe closes: a reward worker killed at its deadline, a trainer killed) or has not
ended the run by the wall-clock limit plus _GUARD_GRACE_S (see _start_guard).

In-process (always; an audit hook, PEP 578, installed before the program runs; "audit_hook" layer when it
enforces): any of these ends the run at once with status "blocked" and zero tests passed: process creation
(os.fork/exec*/spawn*/posix_spawn/system, subprocess, pty), signals to other processes, sockets, ctypes,
subinterpreters, crafted code objects, rlimit changes, tracing/profiling hooks, gc walks, more audit hooks,
os.chdir, links and symlinks, opening or changing (chmod/chown/rename/remove/mkdir/utime/truncate/xattr)
anything outside the working directory for writing, ``os.open`` of anything outside it (its descriptor could
be a ``dir_fd``), reading anything but the working directory, the standard library and /dev/null,
/dev/zero, /dev/urandom, loading native modules from outside the standard library, sqlite3 databases
outside the working directory, importing _posixsubprocess, ctypes, dbm C modules or subinterpreter modules.

What is NOT contained. The audit hook is a tripwire, not a security boundary: a program can get around it
(for example with a native module loaded from a memfd, or crafted bytecode). Where the kernel layers apply,
that buys nothing: the program's process holds neither the tests nor the results pipe, sees no file but
the standard library, cannot reach the network or another process, and has no capability. Without
namespaces (``Isolation(namespaces=False)``: the kernel refuses user namespaces), the program runs as the
trainer's user in the trainer's file system: seccomp keeps it from signalling or tracing the trainer and
the judge, but the hook alone keeps it from reading and writing the user's files and the datasets, from the
network, and from loading native code from its working directory; the working directory is then on the
host's disk, limited per file by ``RLIMIT_FSIZE`` only. Threads are refused only by
``RLIMIT_NPROC`` (Python 3.11 has no audit event for them). Tests may see only what crosses as plain data:
module-level constants and classes of the program are not visible to them, and a program function named
like a builtin (``set``, ``sorted``) is not exposed (the tests keep the builtin).

Run ``python -m tasks._sandbox`` (from the repository root) to print the layers this machine applies.
"""

from __future__ import annotations

import json
import os
import sys

_EXIT_BLOCKED = 86
_FRAME_DIGITS = 10  # a frame on a pipe: its length in ten ASCII digits, then that many bytes of JSON

# A value crossing between the processes holds at most this many items, in at most this many bytes of
# JSON; a bigger value fails the call.
_PLAIN_NODE_LIMIT = 1_000_000
_REPLY_LIMIT = 16 << 20

# Clone flags and mount constants (linux/sched.h, linux/mount.h).
_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWUSER, _CLONE_NEWPID = 0x00020000, 0x40000000, 0x10000000, 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_MOUNT_SETATTR = 442  # the same on every architecture since Linux 5.12
# System calls the program's process may not make (seccomp; they fail with EPERM), per architecture: the
# audit architecture, then the numbers of: kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo,
# pidfd_send_signal, pidfd_open, pidfd_getfd (signals to, or handles on, other processes: the trainer when
# there is no pid namespace), ptrace, process_vm_readv, process_vm_writev (other processes' memory),
# memfd_create (native code from memory), unshare, setns, mount, umount2, pivot_root, chroot (the file
# system view), bpf, perf_event_open, userfaultfd, io_uring_setup (kernel attack surface).
_SECCOMP_REFUSED = {
    "x86_64": (
        0xC000003E,
        (62, 200, 234, 129, 297, 424, 434, 438, 101, 310, 311, 319, 272, 308, 165, 166, 155, 161, 321, 298, 323, 425),
    ),
    "aarch64": (
        0xC00000B7,
        (129, 130, 131, 138, 240, 424, 434, 438, 117, 270, 271, 279, 97, 268, 40, 39, 41, 51, 280, 241, 282, 425),
    ),
}  # fmt: skip


# ============================================================================================ both sides
# The wire format between the judge and the program's process. Standard library only.


def _frame(message) -> bytes:
    data = json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return b"%0*d" % (_FRAME_DIGITS, len(data)) + data


def _write_frame(fd: int, message) -> None:
    view = memoryview(_frame(message))
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, limit: int):
    """The next message on ``fd``; ValueError for a malformed or oversized frame, EOFError at the end.
    Reads exactly the frame's bytes, never ahead (the judge forks between two frames of its stdin)."""
    header = _read_exact(fd, _FRAME_DIGITS)
    if not header.isdigit():
        raise ValueError("malformed frame header")
    size = int(header)
    if size > limit:
        raise ValueError(f"a frame of {size} bytes is over the limit of {limit}")
    return json.loads(_read_exact(fd, size).decode("ascii"))


# defaultdict factories that can cross (by name): a program's own factory is code, not data.
_FACTORIES = ("int", "float", "str", "list", "tuple", "set", "frozenset", "dict", "bool")
# Modules the tests may use under the name the program bound them to (MBPP tests run in the program's
# namespace and sometimes use its imports); the judge binds its own copy, never the program's.
_TEST_MODULES = frozenset(
    {"math", "cmath", "re", "collections", "heapq", "itertools", "functools", "operator", "string", "bisect",
     "statistics", "fractions", "decimal"}
)  # fmt: skip


def _encode(value):
    """Plain data as a JSON tree of tagged nodes; TypeError for anything else. Plain data: None, bool, int,
    float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict, and collections' deque,
    OrderedDict, Counter and defaultdict (with a built-in factory), nested.

    Types are compared by identity (a subclass of int or list could override ``__eq__``), so no code of the
    value's own runs. Floats travel as hex (exact, inf and nan included), ints as hex (no digit limit).
    """
    import builtins
    import collections

    count = 0

    def pairs(mapping) -> list:
        return [[node(key), node(element)] for key, element in dict.items(mapping)]

    def node(item):
        nonlocal count
        count += 1
        if count > _PLAIN_NODE_LIMIT:
            raise TypeError("the value holds too many items")
        cls = type(item)
        if item is None:
            return ["N"]
        if cls is bool:
            return ["b", item]
        if cls is int:
            return ["i", format(item, "x")]
        if cls is float:
            return ["f", item.hex()]
        if cls is complex:
            return ["c", item.real.hex(), item.imag.hex()]
        if cls is str:
            return ["s", item]
        if cls is bytes or cls is bytearray:
            return ["y" if cls is bytes else "Y", item.hex()]
        if cls is list or cls is tuple or cls is set or cls is frozenset:
            tag = "l" if cls is list else "t" if cls is tuple else "S" if cls is set else "F"
            return [tag, [node(element) for element in item]]
        if cls is dict or cls is collections.OrderedDict or cls is collections.Counter:
            return ["d" if cls is dict else "o" if cls is collections.OrderedDict else "C", pairs(item)]
        if cls is collections.deque:
            return ["q", [node(element) for element in item], item.maxlen]
        if cls is collections.defaultdict:
            factory = item.default_factory
            names = [name for name in _FACTORIES if factory is getattr(builtins, name)]
            if factory is not None and not names:
                raise TypeError("a defaultdict whose factory is not a built-in type is not plain data")
            return ["D", pairs(item), names[0] if names else None]
        raise TypeError(f"a {cls.__name__} is not plain built-in data")

    try:
        return node(value)
    except RecursionError:
        raise TypeError("the value is nested too deeply") from None


def _decode(tree):
    """The value ``_encode`` encoded, rebuilt from fresh objects of the judge's own types; ValueError for
    any other tree."""
    import builtins
    import collections

    def pairs(data) -> dict:
        if type(data) is not list:
            raise ValueError("malformed mapping")
        result = {}
        for pair in data:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed mapping item")
            result[node(pair[0])] = node(pair[1])
        return result

    def node(item):
        if type(item) is not list or not item or type(item[0]) is not str:
            raise ValueError("malformed value")
        tag, payload = item[0], item[1:]
        if tag == "N" and not payload:
            return None
        if len(payload) == 2:
            first, second = payload
            if tag == "c" and type(first) is str and type(second) is str:
                return complex(float.fromhex(first), float.fromhex(second))
            if tag == "q" and type(first) is list and (second is None or type(second) is int):
                return collections.deque([node(element) for element in first], second)
            if tag == "D" and (second is None or second in _FACTORIES):
                return collections.defaultdict(
                    None if second is None else getattr(builtins, second), pairs(first)
                )
        if len(payload) != 1:
            raise ValueError("malformed value")
        (data,) = payload
        if tag == "b" and type(data) is bool:
            return data
        if tag in ("i", "f", "s", "y", "Y") and type(data) is str:
            if tag == "i":
                return int(data, 16)
            if tag == "f":
                return float.fromhex(data)
            if tag == "s":
                return data
            return bytes.fromhex(data) if tag == "y" else bytearray.fromhex(data)
        if tag in ("l", "t", "S", "F") and type(data) is list:
            items = [node(element) for element in data]
            return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
        if tag in ("d", "o", "C"):
            return {"d": dict, "o": collections.OrderedDict, "C": collections.Counter}[tag](pairs(data))
        raise ValueError(f"unknown value tag {tag!r}")

    try:
        return node(tree)
    except (TypeError, RecursionError, OverflowError) as error:  # an unhashable key, a bad hex string
        raise ValueError(f"malformed value: {error}") from None


# ============================================================================================ judge
# Trusted. Runs in the judge process (standard library only): reads the job, sets up the namespaces, starts
# the program's process, then runs the tests.


class _ProgramGone(Exception):
    """The program's process ended, was blocked, or broke the protocol: no further call can be answered."""


class _ProgramMemoryError(Exception):
    """The program ran out of memory while answering a call."""


def _judge_main(result_fd: int, lifeline: int) -> None:
    import builtins
    import select

    job = _read_frame(0, 1 << 30)  # the program's part; the tests are read only after the fork below
    guard = _start_guard(lifeline, job["workdir"], job["deadline_s"], job["uid"])
    os.close(lifeline)
    libc = _libc()
    layers = _judge_namespaces(libc) if job["namespaces"] and libc is not None else []

    request_read, request_write = os.pipe()
    reply_read, reply_write = os.pipe()
    status_read, status_write = os.pipe()
    init_pid = os.fork()
    if init_pid == 0:
        os.close(result_fd)
        for fd in (request_write, reply_read, status_read):
            os.close(fd)
        _init_main(job, libc, request_read, reply_write, status_write)
    for fd in (request_read, reply_write, status_write):
        os.close(fd)
    # The judge's memory is about to hold the expected answers: no process of the same user may read it
    # through /proc/<pid>/mem or ptrace (matters when the program runs as the trainer's user), and the
    # values the program returns may not take more memory than the program itself may use.
    if libc is not None:
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    import resource

    _set_limit(resource, resource.RLIMIT_AS, job["limits"]["memory_bytes"])

    tests = _read_frame(0, 1 << 30)
    nonce_prefix = ("\n" + tests["nonce"] + " ").encode()

    def report(line: str) -> None:
        os.write(result_fd, nonce_prefix + line.encode("utf-8", "replace") + b"\n")

    gone = None  # why the program can no longer answer, once it cannot

    def receive():
        nonlocal gone
        try:
            message = _read_frame(reply_read, _REPLY_LIMIT)
        except (EOFError, ValueError, OSError) as error:
            gone = gone or f"no answer ({error})"
            raise _ProgramGone(gone) from None
        if type(message) is not list or not message or type(message[0]) is not str:
            gone = gone or "a malformed answer"
            raise _ProgramGone(gone)
        if message[0] == "blocked":
            gone = "blocked " + (str(message[1])[:200] if len(message) > 1 else "")
            raise _ProgramGone(gone)
        return message

    def send(fd, message) -> None:
        nonlocal gone
        try:
            _write_frame(fd, message)
        except OSError as error:
            gone = gone or f"no answer ({error})"
            raise _ProgramGone(gone) from None

    def call(name: str, args: tuple, kwargs: dict):
        if gone is not None:
            raise _ProgramGone(gone)
        request = [
            "call",
            name,
            _encode(list(args)),
            [[key, _encode(value)] for key, value in kwargs.items()],
        ]
        send(request_write, request)
        reply = receive()
        kind = reply[0] if type(reply) is list and reply else None
        if kind == "return" and len(reply) == 2:
            try:
                return _decode(reply[1])
            except ValueError:
                raise TypeError("the function returned something other than plain built-in data") from None
        if kind == "raise" and len(reply) == 3:
            raise _builtin_error(builtins, reply[1])(str(reply[2])[:200])
        if kind == "memory":
            raise _ProgramMemoryError()
        raise TypeError("the function returned something other than plain built-in data")

    def proxy(name: str):
        def program_function(*args, **kwargs):
            return call(name, args, kwargs)

        program_function.__name__ = program_function.__qualname__ = name
        return program_function

    try:
        ready = receive()
        layers += [str(layer) for layer in ready[1]]
        report("layers " + ",".join(layers))
        send(request_write, ["go"])
        loaded = (
            receive()
        )  # sent after the program ran: a program that tampered with its process may garble it
        kind = loaded[0]
        if kind in ("syntax_error", "load_error") and len(loaded) == 2:
            report(f"{kind} {str(loaded[1])[:100]}")
        elif kind == "memory":
            report("memory")
        elif kind == "loaded" and len(loaded) == 3 and type(loaded[1]) is list and type(loaded[2]) is dict:
            modules = {str(name): str(module) for name, module in loaded[2].items()}
            _run_tests(tests, [str(name) for name in loaded[1]], modules, proxy, report, builtins)
        else:
            gone = "a malformed answer"
    except _ProgramGone:
        pass
    if gone is not None:
        report(gone if gone.startswith("blocked ") else "program_gone")
    os.close(request_write)
    # The program's process exits at the end of the requests; its init passes on how it ended.
    status = None
    if select.select([status_read], [], [], 1.0)[0]:
        answer = os.read(status_read, 64)
        if answer.strip().lstrip(b"-").isdigit():
            status = int(answer)
    if status is None:
        os.kill(init_pid, 9)
    else:
        report(f"program_exit {status}")
    os.waitpid(init_pid, 0)
    os.kill(guard, 9)  # the run ended in time: the trainer's side removes the working directory
    os.waitpid(guard, 0)
    report("done")


def _run_tests(tests: dict, program_names: list[str], program_modules: dict, proxy, report, builtins) -> None:
    """Run the test steps in a namespace of the judge's own, where the program's functions are proxies
    (``program_names``) and its imports of _TEST_MODULES are the judge's copies (``program_modules``: name
    in the program -> module name)."""
    import importlib

    namespace = {"__builtins__": builtins, "__name__": "tests"}
    if tests["context"] is not None:
        # HumanEval: the tests see the prompt's own helpers (a program cannot redefine encode_cyclic to make
        # its decode_cyclic pass) and the program's entry point as ``candidate``.
        try:
            exec(compile(tests["context"], "<context>", "exec"), namespace)
        except BaseException as error:  # noqa: BLE001 - trusted code, but it must not take the judge down
            report("context_error " + _error_name(builtins, error))
            return
    else:
        # MBPP: the tests call the program's functions by name; a name of a builtin keeps the builtin.
        for name, module in program_modules.items():
            if name.isidentifier() and name not in vars(builtins) and module in _TEST_MODULES:
                namespace[name] = importlib.import_module(module)
        for name in program_names:
            if name.isidentifier() and not name.startswith("__") and name not in vars(builtins):
                namespace[name] = proxy(name)
    candidate = tests["candidate"]
    if candidate is not None and candidate in program_names:
        namespace["candidate"] = namespace[candidate] = proxy(candidate)
    for index, (source, counted) in enumerate(tests["steps"]):
        try:
            exec(compile(source, "<test>", "exec"), namespace)
        except _ProgramGone:
            raise
        except _ProgramMemoryError:
            if counted:
                report(f"memory {index}")
            continue
        except BaseException as error:  # noqa: BLE001 - a failing test, whatever it raised
            if counted:
                report(f"fail {index} {_error_name(builtins, error)}")
            continue
        if counted:
            report(f"pass {index}")


def _builtin_error(builtins, name) -> type:
    """The built-in exception class called ``name`` (a program's own classes arrive as Exception), except
    that StopIteration and StopAsyncIteration arrive as RuntimeError: raised inside ``map``, ``filter`` or a
    generator of the tests, they would end its iteration silently, and ``all(map(f, xs))``,
    ``list(filter(f, xs)) == []`` or ``set(map(f, xs)) <= {...}`` would pass for a program whose every call
    fails (PEP 479 turns them into RuntimeError at a generator's boundary for the same reason)."""
    value = vars(builtins).get(name) if type(name) is str else None
    if type(value) is not type or not issubclass(value, BaseException):
        return Exception
    return RuntimeError if issubclass(value, (StopIteration, StopAsyncIteration)) else value


def _error_name(builtins, error: BaseException) -> str:
    cls = type(error)
    return cls.__name__ if vars(builtins).get(cls.__name__) is cls else "Exception"


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return libc
    except (ImportError, OSError):
        return None


def _judge_namespaces(libc) -> list[str]:
    """New pid and network namespaces for everything the judge starts (and, without root, the user
    namespace that allows them); [] when the kernel refuses."""
    if os.geteuid() == 0:
        return ["pidns", "netns"] if libc.unshare(_CLONE_NEWPID | _CLONE_NEWNET) == 0 else []
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNET) != 0:
        return []
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        return []
    return ["userns", "pidns", "netns"]


# ============================================================================================ init
# Pid 1 of the sandbox's pid namespace (when there is one): starts the program's process, reaps it (and
# any orphan), and tells the judge how it ended. Init itself cannot be killed by a signal from inside the
# namespace that it does not handle, which is why the program is not pid 1 (SIGXCPU would not end it).


def _init_main(job: dict, libc, request_read: int, reply_write: int, status_write: int) -> None:
    program_pid = os.fork()
    if program_pid == 0:
        os.close(status_write)
        _program_main(job, libc, request_read, reply_write)
    for fd in (0, request_read, reply_write):
        os.close(fd)
    status = None
    while True:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == program_pid:
            status = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
            break  # in a pid namespace, leaving kills what else is in it; otherwise the trainer's sweep does
    if status is not None:
        os.write(status_write, str(status).encode())
    os._exit(0)


# ============================================================================================ program
# Untrusted from the moment the program runs: the program may rewrite anything here, which is why the judge
# trusts nothing it receives but plain data, checked again on its side.


def _program_main(job: dict, libc, request_read: int, reply_write: int) -> None:
    import builtins
    import resource
    import types

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if libc is not None:
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL: the program dies with its init
    layers, readable_dirs = _contain(job, libc, resource)
    flush_streams = _make_flush(sys.stdout, sys.stderr)
    audit_enforced = job["audit_hook"]
    if audit_enforced:
        layers.append("audit_hook")
    _write_frame(reply_write, ["ready", layers])
    # The program starts only once the judge has reported the layers: a run that floods its output at once
    # is then still a run of the program (output_limit), not a sandbox that did not start.
    try:
        _read_frame(request_read, 64)
    except (EOFError, ValueError):
        os._exit(0)

    sys.addaudithook(
        _make_audit_hook(
            reply_write=reply_write,
            workdir=job["workdir"],
            readable_dirs=readable_dirs,
            enforce=audit_enforced,
            flush_streams=flush_streams,
        )
    )

    def finish():
        flush_streams()
        os._exit(0)

    try:
        program = compile(job["program"], "<solution>", "exec")
    except BaseException as error:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        _write_frame(reply_write, ["syntax_error", type(error).__name__])
        finish()
    # A real module in sys.modules: dataclasses, typing and pickle look classes' modules up there. Not
    # "__main__": a program's `if __name__ == "__main__":` demo block is not run (as in HumanEval).
    module = types.ModuleType("solution")
    namespace = module.__dict__
    namespace["__builtins__"] = builtins
    sys.modules["solution"] = module
    del job
    try:
        exec(program, namespace)
    except MemoryError:
        _write_frame(reply_write, ["memory"])
        finish()
    except BaseException as error:  # noqa: BLE001 - the program's failure, reported by name
        _write_frame(reply_write, ["load_error", type(error).__name__])
        finish()
    names, modules = [], {}
    for name, value in list(namespace.items()):
        if type(name) is str and type(value) is types.ModuleType and type(value.__name__) is str:
            modules[name] = value.__name__
        elif type(name) is str and callable(value):
            names.append(name)
    _write_frame(reply_write, ["loaded", names, modules])
    _serve(namespace, request_read, reply_write, finish)


def _serve(namespace: dict, request_read: int, reply_write: int, finish) -> None:
    """Answer call requests until the judge closes the pipe. The program can tamper with this process,
    but all it can send back is plain data, which it could as well have returned."""
    while True:
        try:
            request = _read_frame(request_read, 1 << 30)
        except (EOFError, ValueError):
            finish()
        _, name, args, kwargs = request
        try:
            value = namespace[name](*_decode(args), **{key: _decode(item) for key, item in kwargs})
            reply = ["return", _encode(value)]
        except MemoryError:
            reply = ["memory"]
        except BaseException as error:  # noqa: BLE001 - raised by the program: the test sees it by name
            reply = ["raise", type(error).__name__, ""]
        _write_frame(reply_write, reply)


def _install_seccomp(libc) -> bool:
    """A seccomp filter that makes the system calls in _SECCOMP_REFUSED fail with EPERM; False where the
    architecture is unknown or the kernel refuses (needs no_new_privs first)."""
    import ctypes
    import platform

    table = _SECCOMP_REFUSED.get(platform.machine())
    if table is None:
        return False
    arch, numbers = table

    class Instruction(ctypes.Structure):  # struct sock_filter, linux/filter.h
        _fields_ = [
            ("code", ctypes.c_uint16),
            ("jt", ctypes.c_uint8),
            ("jf", ctypes.c_uint8),
            ("k", ctypes.c_uint32),
        ]

    class Program(ctypes.Structure):  # struct sock_fprog
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]

    load, jump_eq, jump_ge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, ...
    allow, refuse, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000  # RET_ALLOW, RET_ERRNO|EPERM, KILL_PROCESS
    code = [(load, 0, 0, 4), (jump_eq, 1, 0, arch), (ret, 0, 0, kill), (load, 0, 0, 0)]
    code.append((jump_ge, len(numbers) + 1, 0, 0x40000000))  # the x32 ABI's numbers: refused as a whole
    for index, number in enumerate(numbers):
        code.append((jump_eq, len(numbers) - index, 0, number))
    code += [(ret, 0, 0, allow), (ret, 0, 0, refuse)]
    instructions = (Instruction * len(code))(*[Instruction(*item) for item in code])
    program = Program(len(code), instructions)
    return libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _contain(job: dict, libc, resource) -> tuple[list[str], dict[int, str]]:
    """The private root, rlimits, the uid drop (or dropped capabilities) and no_new_privs, in that order;
    returns (layers applied, {fd: directory} of sys.path directories reachable through /proc/self/fd after
    a uid drop without a private root)."""
    layers: list[str] = []
    workdir, uid = job["workdir"], job["uid"]
    limits = job["limits"]
    private_root = False
    if job["namespaces"] and libc is not None:
        private_root = _private_root(libc, workdir, limits["disk_bytes"], limits["files"], uid)
        if private_root:
            layers += ["private_root", "tmpfs_workdir"]
    os.chdir(workdir)

    _set_limit(resource, resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)
    _set_limit(resource, resource.RLIMIT_AS, limits["memory_bytes"])
    _set_limit(resource, resource.RLIMIT_FSIZE, limits["file_bytes"])
    _set_limit(resource, resource.RLIMIT_NOFILE, limits["open_files"])
    _set_limit(resource, resource.RLIMIT_CORE, 0)
    if uid is not None:
        _set_limit(resource, resource.RLIMIT_NPROC, 1 + limits["processes"])  # this uid runs only us
    elif limits["processes"] == 0:
        _set_limit(resource, resource.RLIMIT_NPROC, 1)  # the user already has >= 1 process: every fork fails
    layers.append("rlimits")

    readable_dirs: dict[int, str] = {}
    if uid is not None:
        if not private_root:
            # The stdlib may live under a private home (/root): reach it through fds opened before the drop.
            for index, entry in enumerate(sys.path):
                if os.path.isdir(entry):
                    fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
                    readable_dirs[fd] = entry
                    sys.path[index] = f"/proc/self/fd/{fd}"
            # Packages imported at startup (encodings, ...) find their submodules through __path__.
            for module in list(sys.modules.values()):
                package_path = getattr(module, "__path__", None)
                if type(package_path) is list:
                    package_path[:] = [_through_fd(entry, readable_dirs) for entry in package_path]
            sys.path_importer_cache.clear()
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if libc is not None and not private_root:
            libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: lets the new uid open its own /proc/self/fd
        layers.append(f"uid:{uid}")
    elif private_root and _drop_capabilities(libc):
        layers.append("no_caps")
    if libc is not None and libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
        layers.append("no_new_privs")
        if _install_seccomp(libc):
            layers.append("seccomp")
    for name in [n for n in sys.modules if n in ("ctypes", "_ctypes") or n.startswith("ctypes.")]:
        del sys.modules[name]
    return layers, readable_dirs


def _private_root(libc, workdir: str, disk_bytes: int, files: int, uid: int | None) -> bool:
    """Enter a new mount namespace whose root holds only what the interpreter needs (see the module
    docstring) and a size-limited tmpfs at ``workdir``; False when the kernel refuses (nothing changed
    for the caller that matters: the host's mounts are untouched either way)."""
    import ctypes
    import platform

    pivot_root = _SYS_PIVOT_ROOT.get(platform.machine())
    if pivot_root is None or libc.unshare(_CLONE_NEWNS) != 0:
        return False

    class MountAttr(ctypes.Structure):  # struct mount_attr, linux/mount.h
        _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]

    attr_rdonly, attr_nosuid, attr_nodev = 0x1, 0x2, 0x4
    at_fdcwd, at_recursive = -100, 0x8000

    def mount(source, target, fstype, flags, data=None) -> bool:
        encode = lambda value: None if value is None else os.fsencode(value)  # noqa: E731
        return libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) == 0

    def read_only(target: str, recursive: bool) -> bool:
        attr = MountAttr(attr_rdonly | attr_nosuid | attr_nodev, 0, 0, 0)
        flags = at_recursive if recursive else 0
        return (
            libc.syscall(_SYS_MOUNT_SETATTR, at_fdcwd, os.fsencode(target), flags, ctypes.byref(attr), 32)
            == 0
        )

    root = workdir  # the empty host directory serves as the mount point of the new root
    if not (
        mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing propagates to the host
        and mount("sandbox-root", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
    ):
        return False
    stdlib = [entry for entry in sys.path if os.path.isdir(entry)]
    binds = [path for path in ("/usr/lib", "/usr/lib64", "/lib", "/lib64") if os.path.isdir(path)]
    binds = [path for path in binds if not os.path.islink(path)]
    binds += [
        path for path in stdlib if not any(_under(path, other) for other in binds + stdlib if other != path)
    ]
    for path in binds:
        target = root + path
        os.makedirs(target, exist_ok=True)
        if not (mount(path, target, None, _MS_BIND | _MS_REC) and read_only(target, recursive=True)):
            return False
    for link in ("/lib", "/lib64"):
        if os.path.islink(link):
            os.symlink(os.readlink(link), root + link)
    # Other Python installations' packages (the system python3's dist-packages) and the interpreter's own
    # site-packages: empty read-only tmpfs on top.
    hidden = [
        os.path.join(parent, name)
        for parent in ("/usr/lib", "/usr/lib64")
        if os.path.isdir(parent)
        for name in os.listdir(parent)
        if name.startswith("python")
    ]
    hidden = [path for path in hidden if not any(_under(entry, path) for entry in stdlib)]
    hidden += [os.path.join(entry, name) for entry in stdlib for name in ("site-packages", "dist-packages")]
    for path in hidden:
        if os.path.isdir(path) and not os.path.islink(path):
            if not mount(
                "hidden", root + path, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k,mode=555"
            ):
                return False
            read_only(root + path, recursive=False)
    os.makedirs(root + "/dev")
    for device in _READABLE_DEVICES:
        with open(root + device, "w"):
            pass
        if not mount(device, root + device, None, _MS_BIND):
            return False
    os.makedirs(root + workdir)
    # nr_inodes caps the entries (files, folders, links), whose kernel memory size= does not count
    options = f"size={max(1, disk_bytes)},nr_inodes={max(2, files)},mode=700" + (f",uid={uid},gid={uid}" if uid is not None else "")
    if not (
        mount("sandbox-work", root + workdir, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options)
        and read_only(root, recursive=False)
    ):
        return False
    os.chdir(root)
    if libc.syscall(pivot_root, b".", b".") != 0 or libc.umount2(b".", _MNT_DETACH) != 0:
        return False
    os.chdir("/")
    return True


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _drop_capabilities(libc) -> bool:
    """Clear every capability (effective, permitted, inheritable) of this process: the root of a user
    namespace could otherwise mount over the private root or undo its read-only flags."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]

    for capability in range(64):  # the bounding set too, so that nothing regains them
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    return libc.capset(ctypes.byref(header), data) == 0


def _through_fd(path: str, readable_dirs: dict[int, str]) -> str:
    """``path`` under one of the directories opened before the uid drop, rewritten to go through its fd."""
    for fd, directory in readable_dirs.items():
        if path == directory or path.startswith(directory + "/"):
            return f"/proc/self/fd/{fd}" + path[len(directory) :]
    return path


def _set_limit(resource, which: int, soft: int, hard: int | None = None) -> None:
    hard = soft if hard is None else hard
    _, current_hard = resource.getrlimit(which)
    if current_hard != resource.RLIM_INFINITY:  # only real root could raise it (not a user namespace's)
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(which, (soft, hard))


# Audit events refused outright (exact names, then prefixes).
_BLOCKED_EVENTS = frozenset(
    {
        "os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
        "os.startfile", "os.chdir", "os.link", "os.symlink", "os.mkfifo", "os.mknod",
        "signal.pthread_kill", "sys.settrace", "sys.setprofile", "sys.addaudithook", "sys._current_frames",
        "sys._current_exceptions", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "code.__new__", "cpython.PyInterpreterState_New", "cpython._PySys_ClearAuditHooks",
        "sqlite3.enable_load_extension", "sqlite3.load_extension",
    }
)  # fmt: skip
_BLOCKED_PREFIXES = ("os.exec", "subprocess.", "socket.", "ctypes.", "resource.", "sys.monitoring", "pty.")
_BLOCKED_IMPORTS = frozenset(
    {"_posixsubprocess", "ctypes", "_ctypes", "_dbm", "_gdbm", "_xxsubinterpreters", "_xxinterpchannels"}
)
# Events that change the file system: (positions of path arguments, positions of dir_fd arguments).
_PATH_EVENTS = {
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.chflags": ((0,), ()),
    "os.lchflags": ((0,), ()),
    "os.mkdir": ((0,), (2,)),
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.truncate": ((0,), ()),
    "os.utime": ((0,), (3,)),
    "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_READABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")


def _make_flush(*streams):
    """Flush the interpreter's original stdout/stderr, so that a program's output printed before it was
    stopped still reaches the parent. Through the types' own methods: a program can replace
    ``sys.stdout`` or shadow ``flush`` on the instance, not ``io.TextIOWrapper.flush``."""
    pairs = tuple((type(stream).flush, stream) for stream in streams)
    base_exception = BaseException

    def flush_streams() -> None:
        for flush, stream in pairs:
            try:
                flush(stream)
            except base_exception:
                pass

    return flush_streams


def _make_audit_hook(*, reply_write, workdir, readable_dirs, enforce, flush_streams):
    """The program process's audit hook: when ``enforce``, it ends the process on the events listed in
    the module docstring, after telling the judge why ("blocked").

    Everything it uses is bound here, before the program runs, and it only calls C functions on values of
    exact built-in types, so no program code runs inside it.
    """
    write_frame, exit_now = _write_frame, os._exit
    type_, str_, bytes_, int_, base_exception = type, str, bytes, int, BaseException
    exit_blocked = _EXIT_BLOCKED
    blocked_events, blocked_prefixes, blocked_imports = _BLOCKED_EVENTS, _BLOCKED_PREFIXES, _BLOCKED_IMPORTS
    path_events, write_flags, readable_devices = dict(_PATH_EVENTS), _WRITE_FLAGS, _READABLE_DEVICES
    workdir_slash = workdir + "/"
    # Files may be read only from the working directory, the devices above and the standard library (as
    # the program's process reaches it: sys.path, or the /proc/self/fd/N of a uid drop without namespaces);
    # native modules only from the standard library.
    library_dirs = tuple(entry for entry in sys.path if type_(entry) is str_ and entry.startswith("/"))
    library_dirs += tuple(f"/proc/self/fd/{fd}" for fd in readable_dirs)
    busy = False

    def block(what) -> None:
        try:
            write_frame(reply_write, ["blocked", what[:200]])
        except base_exception:
            pass
        flush_streams()
        exit_now(exit_blocked)

    def normalise(path):
        # Lexical normalisation, no file system access: symlinks cannot be made (os.symlink is refused) and
        # the working directory starts empty, so '..' can be resolved by the name alone.
        if type_(path) is bytes_:
            path = path.decode("utf-8", "surrogateescape")
        elif type_(path) is not str_:
            return None  # a PathLike would run the program's __fspath__ inside this hook
        if not path.startswith("/"):
            path = workdir_slash + path  # os.chdir is refused, so the cwd is still workdir
        parts = []
        for part in path.split("/"):
            if part == "" or part == ".":
                continue
            if part == "..":
                if parts:
                    parts.pop()
                continue
            parts.append(part)
        return "/" + "/".join(parts)

    def inside(path) -> bool:
        normal = normalise(path)
        return normal is not None and (normal == workdir or normal.startswith(workdir_slash))

    def shown(path) -> str:
        return (
            path.decode("utf-8", "replace") if type_(path) is bytes_ else path if type_(path) is str_ else "?"
        )

    def check_open(path, mode, flags) -> None:
        if type_(path) is int_:
            return  # an already open descriptor
        writing = (type_(flags) is int_ and flags & write_flags) or (
            type_(mode) is str_ and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
        )
        if writing:
            if not inside(path):
                block("open for writing " + shown(path))
            return
        normal = normalise(path)
        if normal is None:
            block("open of a non-string path")
        if mode is None and not (normal == workdir or normal.startswith(workdir_slash)):
            # os.open outside the working directory: its descriptor (of a directory) could serve as the
            # dir_fd of a write that the "open" event shows only by its relative name
            block("os.open " + normal)
        if normal in readable_devices or normal == workdir or normal.startswith(workdir_slash):
            return
        if not in_library(normal):
            block("open " + normal)

    def in_library(normal) -> bool:
        for directory in library_dirs:
            if normal == directory or normal.startswith(directory + "/"):
                return True
        return False

    def hook(event, args) -> None:
        nonlocal busy
        if busy or not enforce:
            return  # busy: an event raised by this hook's own work
        busy = True
        try:
            if event in blocked_events or event.startswith(blocked_prefixes):
                block(event)
            elif event == "open":
                check_open(args[0], args[1], args[2])
            elif event == "import":
                if args[0] in blocked_imports:
                    block("import " + shown(args[0]))
                if args[1] is not None:  # a native module's file (Python source is checked as "open")
                    normal = normalise(args[1])
                    if normal is None or not in_library(normal):
                        block("import of native code from " + shown(args[1]))
            elif event in path_events:
                path_positions, dir_fd_positions = path_events[event]
                for position in dir_fd_positions:
                    if args[position] is not None and args[position] != -1:
                        block(event + " with dir_fd")
                for position in path_positions:
                    fd_allowed = event == "os.truncate" and type_(args[position]) is int_
                    if not fd_allowed and not inside(args[position]):
                        block(event + " outside the working directory: " + shown(args[position]))
            elif event == "sqlite3.connect":
                database = args[0]
                if not (type_(database) is str_ and (database == ":memory:" or database == "")):
                    if not inside(database):
                        block("sqlite3.connect outside the working directory")
        finally:
            busy = False

    return hook


# ============================================================================================ cleanup
# Used by the trainer's side after every run and by the judge's guard when the trainer's side is gone, so
# defined above the judge's entry point (the judge never imports the parent side's modules).


def _sweep(session: int, uid: int | None, spare: int | None = None) -> int:
    """SIGKILL every process of the sandbox ``uid``, or in the child's session or process group (the
    child's pid), but ``spare`` (the guard sweeping), until none is left; returns how many were killed.
    Processes that left the session with setsid() are found by uid only (with the uid layer, no process can
    be started at all by default)."""
    import time

    killed = 0
    for _ in range(20):
        found = [pid for pid in _pids() if pid != spare and _belongs(pid, session, uid)]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, 9)  # SIGKILL (the signal module is imported by the parent side only)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
    return killed


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _belongs(pid: int, session: int, uid: int | None) -> bool:
    """A live (not zombie) process of the sandbox uid, or of the child's session or process group."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return False  # already dead; its reaper (pid 1 or a subreaper) owns it now
        if int(fields[2]) == session or int(fields[3]) == session:
            return True
        return uid is not None and os.stat(f"/proc/{pid}").st_uid == uid
    except (OSError, IndexError, ValueError):
        return False


def _remove_tree(path: str) -> None:
    """Delete the directory ``path`` and everything in it, at any depth. Iterative, with one directory
    descriptor open at a time (``shutil.rmtree`` recurses: a couple of thousand nested folders exceed the
    recursion limit and PATH_MAX, and the working directory would leak); each directory is made
    accessible first, since the program may have taken its permissions away."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        os.chmod(path, 0o700)
        fd = os.open(path, flags)
    except FileNotFoundError:
        return
    names: list[str] = []  # the directories from ``path`` down to the one ``fd`` is open on
    try:
        while True:
            child = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if child is not None:
                try:
                    os.chmod(child, 0o700, dir_fd=fd)
                except PermissionError:
                    pass  # not ours to change (the sandbox uid's, as root): root needs no permission
                deeper = os.open(child, flags, dir_fd=fd)
                os.close(fd)
                fd = deeper
                names.append(child)
            elif names:
                parent = os.open("..", flags, dir_fd=fd)
                os.close(fd)
                fd = parent
                os.rmdir(names.pop(), dir_fd=fd)
            else:
                break
    finally:
        os.close(fd)
    os.rmdir(path)


# The judge's own deadline. Without it only the trainer's side (a reward worker) ended a run: a worker killed
# at its reward deadline, a trainer killed with SIGKILL or interrupted left the judge, its init and the
# program running for good (the judge runs in a session of its own) and the working directory on disk. The
# guard is a process, not a thread or a signal timer of the judge: the judge may sit in a long C call of a
# test, and a signal handler or thread would wait for it. It lives outside the judge's process group (so
# that it can kill the group) but in its session (so that the trainer's sweep ends it with the rest).
_GUARD_GRACE_S = 1.0  # past the trainer's own wall-clock limit, which normally ends the run first


def _start_guard(lifeline: int, workdir: str, deadline_s: float, uid: int | None) -> int:
    """Fork the judge's guard and return its pid. The guard waits until ``deadline_s`` seconds have passed
    or ``lifeline`` reads as closed (nothing is ever written to it: the trainer's side holds the other end
    until the run is over, so end of file means that process is gone), then kills the judge's process group
    and every process of the judge's session or the sandbox ``uid``, and removes ``workdir``."""
    judge = os.getpid()
    guard = os.fork()
    if guard != 0:
        return guard
    try:
        import select
        import time

        os.setpgid(0, 0)
        # Hold none of the trainer's pipes open (its reads would wait for the guard): only the lifeline.
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, lifeline)
        os.closerange(lifeline + 1, os.sysconf("SC_OPEN_MAX"))
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not select.select([lifeline], [], [], end - time.monotonic())[0]:
            pass
        try:
            os.killpg(judge, 9)  # the judge and its init (the program dies with its init: PR_SET_PDEATHSIG)
        except ProcessLookupError:
            pass  # the judge's group is gone already (it ended without killing its guard): sweep and remove
        _sweep(judge, uid, spare=os.getpid())
        _remove_tree(workdir)
    finally:
        os._exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["--judge"]:
    _judge_main(int(sys.argv[2]), int(sys.argv[3]))
    os._exit(0)


# ============================================================================================ parent side

import dataclasses  # noqa: E402  (below the child's entry point: the child never imports these)
import logging  # noqa: E402
import secrets  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

log = logging.getLogger(__name__)

STATUSES = ("ok", "syntax_error", "timeout", "memory", "output_limit", "blocked", "crash")
"""``ok``: the harness ran every test step (some may have failed); ``syntax_error``: the program does not
compile; ``timeout``: wall-clock or CPU limit; ``memory``: a MemoryError (address-space limit) in the
program or a test; ``output_limit``: stdout+stderr over ``Limits.output_bytes`` or a file over
``Limits.file_bytes``; ``blocked``: the audit hook refused an action (all tests count as failed);
``crash``: the program raised on load, exited, or the process died."""

SANDBOX_FILE = Path(__file__).resolve()
_KEEP_OUTPUT = 4096  # bytes of the child's stdout+stderr kept in RunResult.output


class SandboxError(RuntimeError):
    """The sandbox itself failed (no process, no harness): nothing is known about the program."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run. ``processes`` is how many processes/threads the program may start
    beyond itself (0: none; enforced by the kernel only with the uid layer). ``disk_mb`` is the size of the
    working directory's tmpfs and ``files`` how many files and folders it holds (with the private root only;
    otherwise only ``file_bytes`` per file holds): a tmpfs capped in bytes alone let a program make empty files
    for its whole deadline, 300-400 MiB of kernel memory per worker."""

    wall_s: float = 10.0
    cpu_s: int = 8
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    open_files: int = 64
    disk_mb: int = 64
    files: int = 4096
    processes: int = 0


@dataclass(frozen=True)
class Isolation:
    """Which layers to request (see the module docstring); ``default_isolation()`` picks what works here."""

    unprivileged_uid: bool = False
    namespaces: bool = False
    audit_hook: bool = True


@dataclass(frozen=True)
class Step:
    """One piece of test code, run in order in the tests' namespace; ``counted`` steps are the tests."""

    source: str
    counted: bool = True


@dataclass(frozen=True)
class RunResult:
    status: str  # one of STATUSES
    passed: int  # counted steps that ran without raising (0 when blocked)
    total: int  # counted steps
    detail: str = ""  # what was blocked, the load error, the signal, ...
    output: str = ""  # the first _KEEP_OUTPUT bytes of stdout+stderr, for debugging
    layers: tuple[str, ...] = ()  # containment actually applied in the child
    wall_s: float = 0.0

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.status == "ok" and self.total > 0 and self.passed == self.total


def run_tests(
    program: str,
    steps: Sequence[Step],
    *,
    context: str | None = None,
    candidate: str | None = None,
    limits: Limits | None = None,
    isolation: Isolation | None = None,
) -> RunResult:
    """Run ``program``, then ``steps`` in order, in a contained child; count the counted steps that pass.

    The tests' namespace is ``context``'s (trusted code such as a HumanEval prompt, executed on its own)
    when given, else the program's own globals (MBPP: tests call its functions by name). ``candidate``
    names a program function the tests see under that name and as ``candidate`` (HumanEval's
    ``check(candidate)``).
    Raises only for sandbox failures (``SandboxError``, ``OSError``: no process, no directory, a harness
    that did not start), never because of the program.
    """
    limits = limits or Limits()
    isolation = default_isolation() if isolation is None else isolation
    counted = [index for index, step in enumerate(steps) if step.counted]
    uid = _fresh_uid() if isolation.unprivileged_uid else None
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="vlm-sandbox-"))
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        nonce = secrets.token_hex(16)
        # Two frames: the program's process is started after the first and before the judge reads the
        # second, so the tests and the nonce never exist in its memory.
        job = {
            "workdir": workdir,
            "program": program,
            "uid": uid,
            "namespaces": isolation.namespaces,
            "audit_hook": isolation.audit_hook,
            "deadline_s": float(limits.wall_s) + _GUARD_GRACE_S,
            "limits": {
                "cpu_s": int(limits.cpu_s),
                "memory_bytes": int(limits.memory_mb) << 20,
                "file_bytes": int(limits.file_bytes),
                "open_files": int(limits.open_files),
                "processes": int(limits.processes),
                "disk_bytes": int(limits.disk_mb) << 20,
                "files": int(limits.files),
            },
        }
        tests = {
            "nonce": nonce,
            "steps": [[step.source, step.counted] for step in steps],
            "context": context,
            "candidate": candidate,
        }
        raw = _run_child(_frame(job) + _frame(tests), workdir, uid, limits)
    finally:
        _remove_tree(workdir)
    return _interpret(raw, nonce, counted, limits)


@dataclass
class _RawRun:
    lines: list[str]  # result-pipe lines carrying the nonce, nonce stripped
    output: bytes
    returncode: int | None
    timed_out: bool
    output_exceeded: bool
    wall_s: float


def _run_child(job: bytes, workdir: str, uid: int | None, limits: Limits) -> _RawRun:
    result_read, result_write = os.pipe()
    # The judge's guard reads the end of this process from the lifeline (see _start_guard); it is closed
    # only after the run's processes are gone.
    lifeline_read, lifeline_write = os.pipe()
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    command = [
        sys.executable, "-I", "-S", "-B", str(SANDBOX_FILE), "--judge", str(result_write), str(lifeline_read)
    ]  # fmt: skip
    start = time.monotonic()
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(result_write, lifeline_read),
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
    except BaseException:
        for fd in (result_read, result_write, lifeline_read, lifeline_write):
            os.close(fd)
        raise
    os.close(result_write)
    os.close(lifeline_read)
    try:
        try:
            process.stdin.write(job)
            process.stdin.close()
        except OSError:
            pass  # the child died before reading its job: judged below by its exit status
        raw = _collect(process, result_read, limits, start)
    finally:
        _kill_all(process, uid)
        process.stdout.close()
        os.close(result_read)
        os.close(lifeline_write)
    raw.returncode = process.returncode
    raw.wall_s = time.monotonic() - start
    return raw


def _collect(process: subprocess.Popen, result_read: int, limits: Limits, start: float) -> _RawRun:
    """Read stdout+stderr (capped) and the result pipe until both close, the child has been gone for a
    moment (a descendant may hold a pipe open), or a limit is hit."""
    output_fd = process.stdout.fileno()
    output, results = bytearray(), bytearray()
    output_total = 0
    timed_out = output_exceeded = False
    deadline = start + limits.wall_s
    open_fds = {output_fd, result_read}
    exited_at = None
    with selectors.DefaultSelector() as selector:
        for fd in open_fds:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while open_fds:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                break
            for key, _ in selector.select(timeout=min(deadline - now, 0.05)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    open_fds.discard(key.fd)
                elif key.fd == output_fd:
                    output_total += len(chunk)
                    if len(output) < _KEEP_OUTPUT:
                        output += chunk[: _KEEP_OUTPUT - len(output)]
                else:
                    results += chunk
            if output_total > limits.output_bytes or len(results) > limits.output_bytes:
                output_exceeded = True
                break
    # What the judge reported before a limit cut the run short (its layers, say) is still in the pipe.
    if result_read in open_fds:
        while len(results) <= limits.output_bytes:
            try:
                chunk = os.read(result_read, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            results += chunk
    return _RawRun(
        lines=results.decode("utf-8", "replace").split("\n"),
        output=bytes(output),
        returncode=None,
        timed_out=timed_out,
        output_exceeded=output_exceeded,
        wall_s=0.0,
    )


def _interpret(raw: _RawRun, nonce: str, counted: list[int], limits: Limits) -> RunResult:
    tag = nonce + " "
    lines = [line[len(tag) :] for line in raw.lines if line.startswith(tag)]
    passed, memory, done, gone = set(), False, False, False
    syntax_error = blocked = load_error = context_error = program_exit = None
    layers: tuple[str, ...] = ()
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind == "pass":
            passed.add(rest)
        elif kind == "memory":
            memory = True
        elif kind == "done":
            done = True
        elif kind == "program_gone":
            gone = True
        elif kind == "program_exit" and rest.lstrip("-").isdigit():
            program_exit = int(rest)
        elif kind == "layers":
            layers = tuple(name for name in rest.split(",") if name)
        elif kind == "syntax_error":
            syntax_error = rest
        elif kind == "blocked":
            blocked = rest
        elif kind == "load_error":
            load_error = rest
        elif kind == "context_error":
            context_error = rest
    if not layers:
        # The judge never got as far as running the program: the sandbox failed, not the program.
        tail = raw.output.decode("utf-8", "replace")[-800:]
        raise SandboxError(f"the sandbox harness did not start (exit {raw.returncode}); its output: {tail}")
    passed_count = sum(str(index) in passed for index in counted)
    # How the program's process ended when it ended early (its init reports it), else how the judge did.
    signal_number = -program_exit if program_exit is not None and program_exit < 0 else None
    if signal_number is None and raw.returncode is not None and raw.returncode < 0:
        signal_number = -raw.returncode
    signal_name = _signal_name(signal_number) if signal_number else ""
    if syntax_error is not None:
        status, detail, passed_count = "syntax_error", syntax_error, 0
    elif blocked is not None:
        status, detail, passed_count = "blocked", blocked, 0
    elif (raw.timed_out and not done) or signal_number == signal.SIGXCPU:
        status, detail = "timeout", f"wall clock over {limits.wall_s:g} s" if raw.timed_out else "CPU limit"
    elif raw.output_exceeded or signal_number == signal.SIGXFSZ:
        status, detail = "output_limit", "output over the cap" if raw.output_exceeded else "file size limit"
    elif memory:
        status, detail = "memory", "MemoryError"
    elif context_error is not None:
        status, detail, passed_count = "crash", f"the test context raised {context_error}", 0
    elif load_error is not None:
        status, detail = "crash", f"the program raised {load_error}"
    elif done and not gone:
        status, detail = "ok", ""
    else:
        status = "crash"
        if signal_name:
            detail = f"killed by {signal_name}"
        elif gone:
            detail = f"the program exited ({program_exit}) before the tests finished"
        else:
            detail = f"the judge exited ({raw.returncode}) before the tests finished"
    return RunResult(
        status=status,
        passed=passed_count,
        total=len(counted),
        detail=detail,
        output=raw.output.decode("utf-8", "replace"),
        layers=layers,
        wall_s=raw.wall_s,
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ---------------------------------------------------------------------------------------------- cleanup


def _kill_all(process: subprocess.Popen, uid: int | None) -> None:
    """Kill the child's process group, the child, and then any survivor found in /proc."""
    if process.returncode is None:  # not reaped yet, so its pid and group id cannot have been reused
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.kill()
        except ProcessLookupError:
            pass
    process.wait()
    _sweep(process.pid, uid)


# ---------------------------------------------------------------------------------------------- isolation


def _fresh_uid() -> int:
    """A random uid in [1e9, 2e9) that this process's user namespace maps (uids that high are never
    assigned to real users); random so that concurrent runs do not share a process count or a sweep."""
    low, high = 1_000_000_000, 2_000_000_000
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(int(v) for v in line.split()) for line in f if line.strip()]
    except OSError:
        ranges = [(0, 0, 2**32 - 1)]
    for inside, _, count in ranges:
        start, end = max(low, inside), min(high, inside + count)
        if end - start >= 1 << 16:
            return start + secrets.randbelow(end - start)
    raise RuntimeError("no unused uid range is mapped in this user namespace")


_PROBE_PROGRAM = "import collections, functools, heapq, itertools, json, math, random, re, string, typing"
# What Isolation.namespaces must give for the probe to keep it (docs/SANDBOX.md, "What each mode guarantees").
_NAMESPACE_LAYERS = frozenset({"pidns", "netns", "private_root", "tmpfs_workdir"})
_default_isolation: Isolation | None = None
_default_lock = threading.Lock()


def default_isolation() -> Isolation:
    """The strongest isolation that works on this machine, probed once per process.

    As root: a fresh uid plus namespaces, falling back to fewer layers if a probe run fails. Otherwise:
    namespaces (an unprivileged user namespace) if the kernel allows them, else the audit hook alone.
    """
    global _default_isolation
    with _default_lock:
        if _default_isolation is None:
            _default_isolation = _probe_isolation()
            log.info("code sandbox isolation: %s", _default_isolation)
        return _default_isolation


def _probe_isolation() -> Isolation:
    root = os.geteuid() == 0
    candidates = [Isolation(unprivileged_uid=root, namespaces=True)]
    if root:
        candidates += [Isolation(unprivileged_uid=True, namespaces=False), Isolation(namespaces=True)]
    for isolation in candidates:
        try:
            result = run_tests(_PROBE_PROGRAM, [Step("assert 1 + 1 == 2")], isolation=isolation)
        except Exception as error:  # noqa: BLE001 - a failed probe just means "try fewer layers"
            log.warning("sandbox probe %s failed to start: %r", isolation, error)
            continue
        if result.all_passed:
            missing = sorted(_NAMESPACE_LAYERS - set(result.layers)) if isolation.namespaces else []
            if not missing:
                return isolation
            log.warning(
                "sandbox: the kernel refused %s; the program will see the trainer's file system and only "
                "the audit hook keeps it from the user's files (docs/SANDBOX.md)",
                ", ".join(missing),
            )
            if not isolation.unprivileged_uid:
                return dataclasses.replace(isolation, namespaces=False)
            continue
        log.warning("sandbox probe %s failed: %s %s", isolation, result.status, result.detail)
    return Isolation()


def describe() -> str:
    """One line naming the layers a run applies on this machine (as recorded by a probe run)."""
    result = run_tests("", [Step("assert True")])
    return f"isolation={default_isolation()} layers={','.join(result.layers)}"


if __name__ == "__main__":
    print(describe())
