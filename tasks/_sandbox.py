"""Run untrusted Python (a model's program plus its tests) in a contained child process.

``run_tests(program, steps, ...)`` starts ``python -I -S -B tasks/_sandbox.py --child`` in a fresh session
and process group, with a scrubbed environment, in a temporary working directory that is removed
afterwards, and returns a ``RunResult``: how many counted test steps passed and a ``status`` (one of
STATUSES). The program and the tests travel on the child's stdin, never on disk (so a program cannot read
its tests), and results come back on a separate pipe, each line tagged with a random per-run nonce that
only the child's audit hook holds (so printing "passed" or writing to that pipe does not forge a result).

Layers, strongest first. Each is applied when the machine allows it and recorded in ``RunResult.layers``;
``default_isolation()`` probes once per process which layers work here.

Kernel-enforced (need root, as on the project's training machines; probed, fail-soft):
  * ``uid:N``        the child drops to a fresh unprivileged uid/gid N (random, unused, no supplementary
                     groups) after its setup. Consequences: files outside the working directory that are not
                     world-writable cannot be written, other users' /proc entries (the trainer's environ and
                     memory) cannot be read, and signals cannot reach other users' processes;
                     ``RLIMIT_NPROC`` counts this uid only, so with the default ``Limits.processes = 0`` no
                     fork, thread or exec succeeds (a fork bomb gets EAGAIN); the end-of-run sweep kills every
                     process of that uid. The interpreter's stdlib is reached through directory fds opened
                     before the drop (``/proc/self/fd/N`` on sys.path), so it works even when the interpreter
                     lives under a private home such as ``/root``.
  * ``netns``        a new, empty network namespace (only a downed loopback): no connection to anything,
                     127.0.0.1 included.
  * ``readonly_fs``  a private mount namespace where every mount is read-only except the working directory
                     (nosuid, nodev, noexec): even world-writable /tmp, /var/tmp and /dev/shm are closed.
  * ``userns``       (non-root only) an unprivileged user namespace that makes ``netns`` possible, where
                     the kernel allows it.
  * ``rlimits``      CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size
                     (``RLIMIT_FSIZE``), open files, no core dumps, and ``RLIMIT_NPROC`` (see above; the
                     kernel ignores it for root, which is why the uid layer matters).
  * ``no_new_privs`` set-uid binaries grant nothing.
Parent-enforced (always): a wall-clock limit; a byte cap on stdout+stderr (the child is killed when it is
exceeded: "output_limit"); at the end the process group is killed and /proc is swept for survivors (same
uid, session or process group) before the working directory is deleted.

In-process (always; an audit hook, PEP 578, installed before the program runs; "audit_hook" layer when it
enforces): any of these ends the run at once with status "blocked" and zero tests passed: process creation
(os.fork/exec*/spawn*/posix_spawn/system, subprocess, pty), signals to other processes, sockets, ctypes,
subinterpreters, crafted code objects, rlimit changes, tracing/profiling hooks, gc walks, more audit hooks,
os.chdir, links and symlinks, opening or changing (chmod/chown/rename/remove/mkdir/utime/truncate/xattr)
anything outside the working directory for writing, ``os.open`` of anything outside it (its descriptor could
be a ``dir_fd``), reading /proc, /sys or /dev (except /dev/null,
/dev/zero, /dev/urandom and the stdlib fds), sqlite3 databases outside the working directory, importing
_posixsubprocess, ctypes, dbm C modules or subinterpreter modules, and inspecting the harness's or the
tests' frames through sys._getframe, tracebacks or ``f_code``.

What is NOT contained. The audit hook is a tripwire, not a security boundary: CPython has no in-process
isolation, and a deliberate program can reach the tests' namespace by walking ``frame.f_back`` from its own
frame (``sys._getframe`` cannot be refused wholesale: namedtuple, typing and dataclasses call it) or can
feed crafted bytecode through ``marshal``. Where the kernel layers apply, that buys at most a forged test
result, never an escape. Without root (no uid layer), the program runs as the trainer's user: reading the
user's files and processes is blocked only by the hook, and ``RLIMIT_NPROC`` (set to 1) counts all of
that user's processes; without namespaces, the network is closed only by the hook. Threads are refused only
by ``RLIMIT_NPROC`` (Python 3.11 has no audit event for them). Tests run with a private copy of the
builtins and private ``math``/``cmath``/``random``/``string``/``copy`` modules (so a program cannot patch
``abs`` or ``math.isclose`` to pass them), and every function they call from the program is wrapped to
accept only plain built-in data (an object whose ``__eq__`` always says True fails the test).

Run ``python -m tasks._sandbox`` (from the repository root) to print the layers this machine applies.
"""

from __future__ import annotations

import os
import sys

# Audit events the harness raises to talk to its own hook (names are arbitrary but must not collide with
# CPython's). Reports are written by the hook, which holds the nonce, and only for events raised by the
# genuine harness frame.
_REPORT_EVENT = "vlm_grpo_ma.sandbox.report"
_PROTECT_EVENT = "vlm_grpo_ma.sandbox.protect"
_EXIT_BLOCKED = 86

# A value a program function returns to the tests is checked item by item, up to this many items; a bigger
# (or self-containing) value fails the test.
_PLAIN_NODE_LIMIT = 1_000_000


# ============================================================================================ child side
# Everything in this section runs in the sandboxed interpreter and uses the standard library only.


def _child_main(result_fd: int) -> None:
    """The harness. After the program has run, everything this frame uses is a local bound beforehand:
    the program can rebind builtins and module attributes, not this frame's locals."""
    import builtins
    import collections
    import json
    import resource
    import types

    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    layers, readable_dirs = _contain(job, resource)

    exec_, compile_, type_, callable_, issubclass_, enumerate_, dict_ = (
        exec, compile, type, callable, issubclass, enumerate, dict,
    )  # fmt: skip
    base_exception, memory_error, exit_ = BaseException, MemoryError, os._exit
    audit = sys.audit
    flush_streams = _make_flush(sys.stdout, sys.stderr)
    builtin_items = tuple(builtins.__dict__.items())  # the tests' builtins, as they are before the program
    private_modules = _private_modules(types)
    real_import = builtins.__import__

    str_ = str

    def private_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and type_(name) is str_ and name in private_modules:
            return private_modules[name]
        return real_import(name, globals, locals, fromlist, level)

    # Values a program function may return to the tests: exact built-in types only (a subclass can override
    # __eq__). Counter is left out on purpose: it is a Python class whose methods a program can patch.
    guard = _make_guard(
        (int, float, complex, bool, str, bytes, type(None)),
        (list, tuple, set, frozenset, collections.deque, bytearray),
        (dict, collections.OrderedDict, collections.defaultdict),
    )
    builtin_errors = tuple(
        value for value in vars(builtins).values() if type(value) is type and issubclass(value, BaseException)
    )

    def error_name(error) -> str:
        cls = type_(error)
        for known in builtin_errors:  # identity only: a program's exception class may run code on lookups
            if cls is known:
                return known.__name__
        return "Exception"

    def finish() -> None:
        flush_streams()
        exit_(0)

    audit_enforced = job["audit_hook"]
    sys.addaudithook(
        _make_audit_hook(
            nonce=job.pop("nonce"),  # from here on the nonce lives only in the hook's closure
            result_fd=result_fd,
            genuine_frame=sys._getframe(),
            workdir=job["workdir"],
            readable_dirs=readable_dirs,
            enforce=audit_enforced,
            flush_streams=flush_streams,
        )
    )
    if audit_enforced:
        layers.append("audit_hook")
    audit(_REPORT_EVENT, "layers " + ",".join(layers))

    try:
        program = compile_(job["program"], "<solution>", "exec")
    except base_exception as error:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        audit(_REPORT_EVENT, "syntax_error " + error_name(error))
        finish()
    compiled = []
    for source, counted in job["steps"]:
        try:
            compiled.append((compile_(source, "<test>", "exec"), bool(counted)))
        except base_exception:
            compiled.append((None, bool(counted)))
    steps = tuple(compiled)  # immutable: a program that reaches this frame cannot swap the tests
    del compiled
    context = None
    if job["context"] is not None:
        try:
            context = compile_(job["context"], "<context>", "exec")
        except base_exception as error:
            audit(_REPORT_EVENT, "context_error " + error_name(error))
            finish()
    candidate = job["candidate"]
    del job

    # Real modules registered in sys.modules: dataclasses, typing and pickle look classes' modules up there.
    # Not "__main__": a program's `if __name__ == "__main__":` demo block is not run (as in HumanEval).
    module_type, modules = types.ModuleType, sys.modules
    program_module = module_type("solution")
    program_ns = program_module.__dict__
    program_ns["__builtins__"] = builtins
    modules["solution"] = program_module
    try:
        exec_(program, program_ns)
    except memory_error:
        audit(_REPORT_EVENT, "memory")
        audit(_REPORT_EVENT, "done")
        finish()
    except base_exception as error:
        audit(_REPORT_EVENT, "load_error " + error_name(error))
        audit(_REPORT_EVENT, "done")
        finish()

    private_builtins = dict_(builtin_items)
    private_builtins["__import__"] = private_import
    test_module = module_type("tests")
    test_ns = test_module.__dict__
    modules["tests"] = test_module
    test_ns["__builtins__"] = private_builtins
    if context is not None:
        # HumanEval: the tests see the prompt's own helpers (a program cannot redefine encode_cyclic to
        # make its decode_cyclic pass) and the program's entry point as ``candidate``.
        try:
            exec_(context, test_ns)
        except base_exception as error:
            audit(_REPORT_EVENT, "context_error " + error_name(error))
            finish()
    else:
        # MBPP: the tests call the program's functions by name; each is wrapped by the guard.
        for name, value in dict_.items(program_ns):
            if type_(name) is not str or name.startswith("__"):
                continue
            is_class = issubclass_(type_(value), type)
            test_ns[name] = guard(value) if callable_(value) and not is_class else value
    test_ns["__builtins__"] = private_builtins
    if candidate is not None:
        entry = dict_.get(program_ns, candidate)
        if entry is not None and callable_(entry):
            # by both names: HumanEval tests mostly say ``candidate`` but some name the function itself
            test_ns["candidate"] = test_ns[candidate] = guard(entry)
    audit(_PROTECT_EVENT, test_ns)

    for index, (code, counted) in enumerate_(steps):
        if code is None:
            if counted:
                audit(_REPORT_EVENT, f"fail {index} SyntaxError")
            continue
        try:
            exec_(code, test_ns)
        except memory_error:
            if counted:
                audit(_REPORT_EVENT, f"memory {index}")
            continue
        except base_exception as error:
            if counted:
                audit(_REPORT_EVENT, f"fail {index} {error_name(error)}")
            continue
        if counted:
            audit(_REPORT_EVENT, f"pass {index}")
    audit(_REPORT_EVENT, "done")
    finish()


def _contain(job: dict, resource) -> tuple[list[str], dict[int, str]]:
    """Namespaces, rlimits, no_new_privs and the uid drop, in that order; returns (layers applied,
    {fd: directory} of sys.path directories reachable through /proc/self/fd after the uid drop)."""
    layers: list[str] = []
    libc = None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
    except (ImportError, OSError):
        pass
    workdir = job["workdir"]
    if job["namespaces"] and libc is not None:
        layers += _enter_namespaces(libc, workdir)
    os.chdir(workdir)  # after the mounts: the cwd must be the writable bind mount, not the read-only original

    uid = job["uid"]
    limits = job["limits"]
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
        for index, entry in enumerate(sys.path):
            if os.path.isdir(entry):
                fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
                readable_dirs[fd] = entry
                sys.path[index] = f"/proc/self/fd/{fd}"
        # Packages imported at startup (collections, encodings, ...) find their submodules through __path__.
        for module in list(sys.modules.values()):
            package_path = getattr(module, "__path__", None)
            if type(package_path) is list:
                package_path[:] = [_through_fd(entry, readable_dirs) for entry in package_path]
        sys.path_importer_cache.clear()
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if libc is not None:
            libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: lets the new uid open its own /proc/self/fd
        layers.append(f"uid:{uid}")
    if libc is not None and libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
        layers.append("no_new_privs")
    for name in [n for n in sys.modules if n in ("ctypes", "_ctypes") or n.startswith("ctypes.")]:
        del sys.modules[name]
    return layers, readable_dirs


def _through_fd(path: str, readable_dirs: dict[int, str]) -> str:
    """``path`` under one of the directories opened before the uid drop, rewritten to go through its fd."""
    for fd, directory in readable_dirs.items():
        if path == directory or path.startswith(directory + "/"):
            return f"/proc/self/fd/{fd}" + path[len(directory) :]
    return path


def _set_limit(resource, which: int, soft: int, hard: int | None = None) -> None:
    hard = soft if hard is None else hard
    _, current_hard = resource.getrlimit(which)
    if current_hard != resource.RLIM_INFINITY and os.geteuid() != 0:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(which, (soft, hard))


def _enter_namespaces(libc, workdir: str) -> list[str]:
    """Root: new network + mount namespaces, every mount read-only but ``workdir``. Otherwise: an
    unprivileged user namespace with a new network namespace, if the kernel allows it."""
    import ctypes

    clone_newns, clone_newnet, clone_newuser = 0x00020000, 0x40000000, 0x10000000
    if os.geteuid() != 0:
        return ["userns", "netns"] if libc.unshare(clone_newuser | clone_newnet) == 0 else []
    if libc.unshare(clone_newns | clone_newnet) != 0:
        return []
    layers = ["netns"]

    class MountAttr(ctypes.Structure):  # struct mount_attr, linux/mount.h
        _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]

    ms_bind, ms_rec, ms_private = 4096, 16384, 1 << 18
    attr_rdonly, attr_nosuid, attr_nodev, attr_noexec = 0x1, 0x2, 0x4, 0x8
    sys_mount_setattr, at_fdcwd, at_recursive = 442, -100, 0x8000  # 442 on every architecture since 5.12
    path = os.fsencode(workdir)

    def setattr_(target: bytes, flags: int, attr: MountAttr) -> bool:
        return libc.syscall(sys_mount_setattr, at_fdcwd, target, flags, ctypes.byref(attr), 32) == 0

    if (
        libc.mount(b"none", b"/", None, ms_rec | ms_private, None) == 0  # nothing propagates to the host
        and libc.mount(path, path, None, ms_bind, None) == 0
        and setattr_(b"/", at_recursive, MountAttr(attr_rdonly, 0, 0, 0))
        and setattr_(path, 0, MountAttr(attr_nosuid | attr_nodev | attr_noexec, attr_rdonly, 0, 0))
    ):
        layers.append("readonly_fs")
    return layers


def _private_modules(types) -> dict:
    """Test-only copies of the modules HumanEval/MBPP tests import: C modules as a copy of their namespace,
    Python modules freshly executed from their source (so patching the shared ``random.Random`` class or
    ``string.ascii_letters`` does not reach the tests)."""
    import cmath
    import importlib.util
    import math

    modules = {}
    for module in (math, cmath):
        private = types.ModuleType(module.__name__)
        private.__dict__.update(module.__dict__)
        modules[module.__name__] = private
    for name in ("random", "string", "copy"):
        spec = importlib.util.find_spec(name)
        private = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(private)
        modules[name] = private
    return modules


def _make_guard(atoms: tuple, sequences: tuple, mappings: tuple):
    """``guard(fn)``: ``fn`` wrapped so that a return value other than plain built-in data raises.

    Types are compared by identity only (``in`` on a tuple would call a metaclass's ``__eq__``), and every
    name used at call time is bound here, before the program runs.
    """
    type_, len_, type_error = type, len, TypeError
    keys, values = dict.keys, dict.values
    node_limit = _PLAIN_NODE_LIMIT

    def plain(value) -> bool:
        stack, seen = [value], 0
        while stack:
            item = stack.pop()
            seen += 1
            if seen > node_limit:
                return False
            cls = type_(item)
            known = False
            for atom in atoms:
                if cls is atom:
                    known = True
            if known:
                continue
            for sequence in sequences:
                if cls is sequence:
                    known = True
            if known:
                if len_(stack) + len_(item) > node_limit:
                    return False
                stack.extend(item)
                continue
            for mapping in mappings:
                if cls is mapping:
                    known = True
            if not known:
                return False
            stack.extend(keys(item))
            stack.extend(values(item))
        return True

    def guard(function):
        def guarded(*args, **kwargs):
            value = function(*args, **kwargs)
            if not plain(value):
                raise type_error("the function returned something other than plain built-in data")
            return value

        return guarded

    return guard


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


def _make_audit_hook(*, nonce, result_fd, genuine_frame, workdir, readable_dirs, enforce, flush_streams):
    """The child's audit hook: writes the harness's reports (and only those) to the result pipe, and when
    ``enforce`` ends the process on the events listed in the module docstring.

    Defensive style on purpose: everything the hook uses is bound here, before the program runs (a program
    can rebind module globals and builtins, not these closure cells), and it only calls C functions on
    values of exact built-in types, so no program code ever runs inside it: its frame, and the nonce in its
    closure, are never on a program's stack.
    """
    write, exit_now, getframe = os.write, os._exit, sys._getframe
    type_, str_, bytes_, int_, getattr_, os_error = type, str, bytes, int, getattr, OSError
    function_type = type(_make_guard)
    report_event, protect_event, exit_blocked = _REPORT_EVENT, _PROTECT_EVENT, _EXIT_BLOCKED
    blocked_events, blocked_prefixes, blocked_imports = _BLOCKED_EVENTS, _BLOCKED_PREFIXES, _BLOCKED_IMPORTS
    path_events, write_flags, readable_devices = dict(_PATH_EVENTS), _WRITE_FLAGS, _READABLE_DEVICES
    guarded_attributes = ("__code__", "__defaults__", "__kwdefaults__", "__globals__", "__closure__")
    prefix = ("\n" + nonce + " ").encode()
    workdir_slash = workdir + "/"
    protected = [genuine_frame.f_globals]  # frames running with these globals are off limits
    readable_prefixes = tuple(f"/proc/self/fd/{fd}" for fd in readable_dirs)
    busy = False

    def emit(line) -> None:
        try:
            write(result_fd, prefix + line.encode("utf-8", "replace") + b"\n")
        except os_error:
            pass

    def block(what) -> None:
        emit("blocked " + what[:200])
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

    def is_protected(frame) -> bool:
        globals_ = frame.f_globals
        for namespace in protected:
            if globals_ is namespace:
                return True
        return False

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
        if normal.startswith(("/proc/", "/sys/", "/dev/")) or normal in ("/proc", "/sys", "/dev"):
            if normal in readable_devices:
                return
            for allowed in readable_prefixes:
                if normal == allowed or normal.startswith(allowed + "/"):
                    return
            block("open " + normal)

    def hook(event, args) -> None:
        nonlocal busy
        if busy:
            return  # an event raised by this hook's own work (sys._getframe, tb_frame below)
        busy = True
        try:
            if event == report_event or event == protect_event:
                if getframe(1) is not genuine_frame:
                    block("a forged report")
                if event == report_event:
                    emit(args[0])
                else:
                    protected.append(args[0])
                return
            if not enforce:
                return
            if event in blocked_events or event.startswith(blocked_prefixes):
                block(event)
            elif event == "open":
                check_open(args[0], args[1], args[2])
            elif event == "import":
                if args[0] in blocked_imports:
                    block("import " + args[0])
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
            elif event == "sys._getframe":
                if is_protected(args[0]):
                    block("sys._getframe into the harness")
            elif event == "object.__getattr__":
                target, name = args[0], args[1]
                if name == "f_code" and is_protected(target):
                    block("f_code of the harness")
                elif name == "tb_frame" and is_protected(target.tb_frame):
                    block("tb_frame of the harness")
            elif event == "object.__setattr__" or event == "object.__delattr__":
                target, name = args[0], args[1]
                if type_(target) is function_type and name in guarded_attributes:
                    globals_ = getattr_(target, "__globals__", None)
                    for namespace in protected:
                        if globals_ is namespace:
                            block(event + " " + name + " of the harness")
        finally:
            busy = False

    return hook


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child_main(int(sys.argv[2]))
    os._exit(0)  # not reached: the harness always leaves through os._exit


# ============================================================================================ parent side

import dataclasses  # noqa: E402  (below the child's entry point: the child never imports these)
import json  # noqa: E402
import logging  # noqa: E402
import secrets  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
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
    beyond itself (0: none; enforced by the kernel only with the uid layer)."""

    wall_s: float = 10.0
    cpu_s: int = 8
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    open_files: int = 64
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
        job = {
            "nonce": nonce,
            "workdir": workdir,
            "program": program,
            "steps": [[step.source, step.counted] for step in steps],
            "context": context,
            "candidate": candidate,
            "uid": uid,
            "namespaces": isolation.namespaces,
            "audit_hook": isolation.audit_hook,
            "limits": {
                "cpu_s": int(limits.cpu_s),
                "memory_bytes": int(limits.memory_mb) << 20,
                "file_bytes": int(limits.file_bytes),
                "open_files": int(limits.open_files),
                "processes": int(limits.processes),
            },
        }
        raw = _run_child(json.dumps(job).encode("utf-8"), workdir, uid, limits)
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
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    command = [sys.executable, "-I", "-S", "-B", str(SANDBOX_FILE), "--child", str(result_write)]
    start = time.monotonic()
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(result_write,),
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
    except BaseException:
        os.close(result_read)
        os.close(result_write)
        raise
    os.close(result_write)
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
    passed, memory, done = set(), False, False
    syntax_error = blocked = load_error = context_error = None
    layers: tuple[str, ...] = ()
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind == "pass":
            passed.add(rest)
        elif kind == "memory":
            memory = True
        elif kind == "done":
            done = True
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
        # The harness never got as far as running the program: the sandbox failed, not the program.
        tail = raw.output.decode("utf-8", "replace")[-800:]
        raise SandboxError(f"the sandbox harness did not start (exit {raw.returncode}); its output: {tail}")
    passed_count = sum(str(index) in passed for index in counted)
    signal_number = -raw.returncode if raw.returncode is not None and raw.returncode < 0 else None
    signal_name = _signal_name(signal_number) if signal_number else ""
    if syntax_error is not None:
        status, detail, passed_count = "syntax_error", syntax_error, 0
    elif blocked is not None:
        status, detail, passed_count = "blocked", blocked, 0
    elif not done and (raw.timed_out or signal_number == signal.SIGXCPU):
        status, detail = "timeout", f"wall clock over {limits.wall_s:g} s" if raw.timed_out else "CPU limit"
    elif raw.output_exceeded or signal_number == signal.SIGXFSZ:
        status, detail = "output_limit", "output over the cap" if raw.output_exceeded else "file size limit"
    elif memory:
        status, detail = "memory", "MemoryError"
    elif context_error is not None:
        status, detail, passed_count = "crash", f"the test context raised {context_error}", 0
    elif load_error is not None:
        status, detail = "crash", f"the program raised {load_error}"
    elif done:
        status, detail = "ok", ""
    else:
        status = "crash"
        detail = (
            f"killed by {signal_name}"
            if signal_name
            else f"exited ({raw.returncode}) before the tests finished"
        )
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


def _sweep(session: int, uid: int | None) -> int:
    """SIGKILL every process of the sandbox ``uid``, or in the child's session or process group (the
    child's pid), until none is left; returns how many were killed. Processes that left the session with
    setsid() are found by uid only (with the uid layer, no process can be started at all by default)."""
    killed = 0
    for _ in range(20):
        found = [pid for pid in _pids() if _belongs(pid, session, uid)]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
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
    def make_writable_and_retry(function, target, _error):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            function(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)


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
            if isolation.namespaces and "netns" not in result.layers:
                return dataclasses.replace(isolation, namespaces=False)
            return isolation
        log.warning("sandbox probe %s failed: %s %s", isolation, result.status, result.detail)
    return Isolation()


def describe() -> str:
    """One line naming the layers a run applies on this machine (as recorded by a probe run)."""
    result = run_tests("", [Step("assert True")])
    return f"isolation={default_isolation()} layers={','.join(result.layers)}"


if __name__ == "__main__":
    print(describe())
