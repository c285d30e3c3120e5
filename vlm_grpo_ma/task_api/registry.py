"""Samples, completions, tasks, and the task registry.

A task is one module that calls ``register_task(Task(...))`` when imported; task authors import what they
need from ``vlm_grpo_ma.task_api`` (the public API; this module is its implementation). The core never imports
a task by name: ``load_builtin_tasks()`` loads every entry point of the group ``vlm_grpo_ma.tasks`` (the
built-in tasks are this project's own entry points in pyproject.toml; an installed third-party package adds
its tasks the same way), and ``import_task_modules()`` imports the extra modules and ``.py`` files a config
names (``data.task_modules``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_grpo_ma.task_api.coords import CoordinateFrame, Size, to_original_pixels

ImageRef = Any  # a file path (str) or a PIL.Image.Image
VideoRef = Any  # a file path (str), or frames (image paths or PIL images) in time order: a FrameList with their rate, or a list


@dataclass(frozen=True)
class Sample:
    """One prompt: image(s) and video(s) + question, with the ground truth the reward needs. Videos are kept
    as paths (or frame lists) and decoded when the prompt is encoded (``task_api.videos``)."""

    task: str
    id: str
    question: str
    images: tuple[ImageRef, ...]
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict)
    videos: tuple[VideoRef, ...] = ()


@dataclass(frozen=True)
class Completion:
    """One sampled (thought, answer) pair and what a reward needs to read it.

    ``input_sizes`` are the (width, height) of each image as the model saw it (after resizing);
    ``original_sizes`` those of the files. ``frame`` is the coordinate frame the model writes in.
    """

    thought: str
    answer: str
    frame: CoordinateFrame = CoordinateFrame.ABSOLUTE_INPUT
    input_sizes: tuple[Size, ...] = ()
    original_sizes: tuple[Size, ...] = ()
    thought_truncated: bool = False
    answer_truncated: bool = False
    # The served judge's verdict on this answer, in [0, 1], for a task with ``Task.judge_query``; None when it
    # gave none (no query, the judge failed or timed out, an unreadable verdict, an answer over the length cap)
    judgement: float | None = None
    # Tool use in the thought (``Task.tools``): calls made, calls that could not be served, and images the tools
    # returned (a crop actually seen: what a conditional tool bonus reads)
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    tool_images: int = 0
    # where each returned crop lies, [x1, y1, x2, y2] in original pixels of the prompt's image (for drawings)
    tool_boxes: tuple[tuple[float, float, float, float], ...] = ()

    @property
    def text(self) -> str:
        """The whole generated text, thought then answer, as the model wrote it."""
        return self.thought + self.answer

    def to_original_pixels(self, values: Sequence[float], image_index: int = 0) -> list[float]:
        """Model-frame ``[x, y, ...]`` -> pixels of original image ``image_index``."""
        return to_original_pixels(
            values, self.frame, self.input_sizes[image_index], self.original_sizes[image_index]
        )


RewardFn = Callable[[Completion, Sample], dict[str, float]]
LoadFn = Callable[..., list[Sample]]  # load(split: str, source: str | None = None) -> list[Sample]
ParseFn = Callable[[Completion, Sample], Any]  # the parsed prediction, JSON-serialisable, for evaluation dumps
DrawFn = Callable[[Any, Sample, Any], Any]  # draw(PIL image, sample, parsed prediction) -> annotated PIL image
TargetFn = Callable[[Sample], str]  # target(sample) -> the whole completion a good model writes for it
JudgeQueryFn = Callable[[Completion, Sample], Any]  # judge_query(completion, sample) -> a judge.JudgeQuery or None


@dataclass(frozen=True)
class Task:
    """``load(split, source)`` gives samples; ``reward(completion, sample)`` gives ``{"reward": r, part: value}``
    and never raises on malformed model output; ``instruction`` is appended to each question and tells the
    model the ``<think>...</think><answer>...</answer>`` format; ``metrics`` names the reward parts worth
    averaging in logs (e.g. ``iou``); ``reward_weights`` are the default weights of the parts in ``"reward"``
    (a config can override them).

    For evaluation: ``success`` names the 0/1 part that means "correct" (accuracy and pass@k are computed
    from it, e.g. ``acc_iou50``); ``parse(completion, sample)`` gives the prediction as the reward read it
    (e.g. the box in original pixels), written to the per-sample dump; ``draw(image, sample, prediction)``
    returns the image with the prediction and the ground truth drawn on it (tasks with boxes or points).

    For a supervised cold start (``python -m vlm_grpo_ma.warmstart --task NAME``): ``target(sample)`` gives the
    whole completion a good model writes for the sample, ``<think>...</think><answer>...</answer>`` in the
    task's format (a thought where the data has one, else a rationale field or a template, and the answer); the
    warm start trains the model on it after the prompt. A task without it cannot be warm-started.

    For answers no rule can check: ``judge_query(completion, sample)`` gives a ``JudgeQuery`` (question,
    reference answers, the answer) or None; the run's served judge (``judge.*`` settings, docs/JUDGE.md) is
    asked every query of a step before the rewards run, and the reward reads the verdict as
    ``completion.judgement`` (in [0, 1], or None). A run with such a task needs ``judge.base_url``.

    For thinking with images: ``tools`` (``task_api.tools.Tool``, e.g. ``ZOOM_TOOL``) the thought may call between
    ``<tool_call>`` and ``</tool_call>``; each result comes back as a new turn and the thought goes on
    (``rollout.max_turns`` calls at most). The reward reads ``completion.tool_calls``, ``invalid_tool_calls``
    and ``tool_images``."""

    name: str
    load: LoadFn
    reward: RewardFn
    instruction: str
    metrics: tuple[str, ...] = ()
    reward_weights: dict[str, float] = field(default_factory=dict)
    success: str | None = None
    parse: ParseFn | None = None
    draw: DrawFn | None = None
    target: TargetFn | None = None
    judge_query: JudgeQueryFn | None = None
    tools: tuple = ()  # task_api.tools.Tool: what the thought may call (docs/TASKS.md, "Tools")
    # The preset (a config file) a run of this task alone uses when it gives no --config: its model (a warm start
    # that knows the task's format, e.g. its tool calls), budgets and turns; the command line's keys go on top
    default_config: str | None = None


def weighted_reward(parts: dict[str, float], weights: dict[str, float]) -> float:
    """The scalar reward: a weighted sum of named reward parts (weights name the parts that count)."""
    return float(sum(weights[name] * parts[name] for name in weights))


_TASKS: dict[str, Task] = {}
_SOURCES: dict[str, str] = {}  # task name -> where it was registered from, for the duplicate-name error

# The entry point group the core loads tasks from. The built-in tasks are entries of this project's own
# pyproject.toml; `pip install -e .` (scripts/setup.sh) writes them into the installed metadata.
ENTRY_POINT_GROUP = "vlm_grpo_ma.tasks"

_loading_entry_point: str | None = None  # the entry point being loaded, named as the source of its tasks


class DuplicateTaskError(ValueError):
    """Two tasks of one name."""


def _defined_in(task: Task) -> str:
    """Where ``task`` was written: the file of the module that defines its reward (a file named in
    ``data.task_modules`` is imported under a made-up module name, which would tell a user nothing)."""
    module_name = getattr(task.reward, "__module__", None) or "(unknown)"
    file = getattr(sys.modules.get(module_name), "__file__", None)
    return f"module {module_name} ({file})" if file else f"module {module_name}"


def register_task(task: Task) -> Task:
    """Add ``task`` to the registry and return it. A second task of the same name raises ValueError naming
    where each came from (an entry point, or the module and file that define the task's reward)."""
    source = _loading_entry_point or _defined_in(task)
    if task.name in _TASKS:
        raise DuplicateTaskError(
            f"task {task.name!r} from {source} is already registered by {_SOURCES[task.name]}; "
            "task names must be unique"
        )
    _TASKS[task.name] = task
    _SOURCES[task.name] = source
    return task


# A question longer than this is no prompt a Qwen-VL model takes (about 25k tokens and more): a 1 MB caption
# made the step that drew it allocate 44 GB, a 100 MB one aborted in the tokenizer. Skipped and counted at load.
MAX_QUESTION_CHARS = 100_000


def load_samples(task: Task, split: str, source: str | None = None) -> list[Sample]:
    """``task.load(split, source)``, checked: a list of ``Sample`` whose ``task`` is the task's name (the core
    looks each sample's task up by it) and whose ids are unique (evaluation keys its records, and a resumed
    evaluation its progress, by id: two rows of one id became one prompt without a word). ValueError naming
    the task, where it is defined and the first bad sample; FileNotFoundError and ValueError of the loader
    pass through. A sample whose question is over ``MAX_QUESTION_CHARS`` is dropped with ``skip_row`` (logged
    naming it, counted as ``overlong_prompts``)."""
    samples = task.load(split, source)
    where = f"task {task.name!r} ({_SOURCES.get(task.name) or _defined_in(task)}): load({split!r})"
    if not isinstance(samples, list):
        raise ValueError(f"{where} returned a {type(samples).__name__}; it must return a list of Sample")
    seen: set[str] = set()
    for sample in samples:
        if not isinstance(sample, Sample):
            raise ValueError(f"{where} returned a {type(sample).__name__} among its samples; each must be a Sample")
        if sample.task != task.name:
            raise ValueError(
                f"{where} returned sample {sample.id!r} with task={sample.task!r}; Sample.task must be the task's "
                f"name, {task.name!r}"
            )
        if sample.id in seen:
            where_from = f" from {source}" if source else ""
            raise ValueError(f"{where}{where_from} returned two samples of id {sample.id!r}; sample ids must be unique")
        seen.add(sample.id)
    kept = []
    for sample in samples:
        if len(sample.question) > MAX_QUESTION_CHARS:
            skip_row("overlong_prompts", f"sample {sample.id!r} of task {task.name!r}",
                     f"its question has {len(sample.question):,} characters, more than {MAX_QUESTION_CHARS:,}")  # fmt: skip
        else:
            kept.append(sample)
    return kept


def get_task(name: str) -> Task:
    load_builtin_tasks()
    try:
        return _TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())}") from None


def task_tools(name: str) -> tuple:
    """The tools task ``name`` declares (``Task.tools``); () for a name no task registered."""
    load_builtin_tasks()
    task = _TASKS.get(name)
    return task.tools if task is not None else ()


def list_tasks() -> list[str]:
    load_builtin_tasks()
    return sorted(_TASKS)


_builtins_loaded = False


def load_builtin_tasks() -> None:
    """Load every entry point of the ``vlm_grpo_ma.tasks`` group once (built-in and installed third-party
    tasks).

    An entry point ``name = "package.module"`` names a module that registers the task ``name`` when imported;
    ``name = "package.module:TASK"`` may instead name a ``Task`` object, which is registered here. Raises
    RuntimeError when the group is empty (the package's metadata is not installed), when an entry point fails
    to load (naming it and the cause), or when it registers no task of its name; DuplicateTaskError (a
    ValueError) on a duplicate task name, naming both sources.
    """
    global _builtins_loaded, _loading_entry_point
    if _builtins_loaded:
        return
    entry_points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if not entry_points:
        raise RuntimeError(
            f"no tasks found: the entry point group {ENTRY_POINT_GROUP!r} is empty, so the vlm-grpo-ma package "
            "metadata is not installed in this environment; run `pip install -e .` in the repository "
            "(scripts/setup.sh does), and again after pyproject.toml's entry points change. A stale "
            "vlm_grpo_ma.egg-info folder in the working directory (left by an older setuptools) hides the "
            "installed metadata: delete it"
        )
    for entry_point in entry_points:
        dist = entry_point.dist.name if entry_point.dist is not None else "an unknown distribution"
        described = f"entry point {entry_point.name} = {entry_point.value!r} (group {ENTRY_POINT_GROUP}, {dist})"
        _loading_entry_point = described
        try:
            loaded = entry_point.load()
        except DuplicateTaskError:
            raise  # it names both sources already
        except Exception as error:
            raise RuntimeError(f"{described} failed to load: {type(error).__name__}: {error}") from error
        finally:
            _loading_entry_point = None
        if isinstance(loaded, Task) and _TASKS.get(loaded.name) is not loaded:
            _loading_entry_point = described
            try:
                register_task(loaded)
            finally:
                _loading_entry_point = None
        if entry_point.name not in _TASKS:
            raise RuntimeError(
                f"{described} loaded, but no task named {entry_point.name!r} is registered; the entry point's "
                "name must be the name of the task its module registers "
                f"(registered: {', '.join(sorted(_TASKS)) or 'none'})"
            )
    _builtins_loaded = True


_IMPORTED_MODULES: list[str] = []


def imported_task_modules() -> tuple[str, ...]:
    """Every module ``import_task_modules`` was given in this process, in order (reward worker processes
    import the same ones, see ``vlm_grpo_ma.task_api.reward_pool``)."""
    return tuple(_IMPORTED_MODULES)


def import_task_modules(modules: Sequence[str]) -> None:
    """Import out-of-tree task modules: dotted module names or paths to ``.py`` files."""
    for module in modules:
        _import_task_module(module)
        recorded = str(Path(module).resolve()) if module.endswith(".py") else module
        if recorded not in _IMPORTED_MODULES:
            _IMPORTED_MODULES.append(recorded)


def _import_task_module(module: str) -> None:
    if module.endswith(".py"):
        path = Path(module).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"task module file not found: {path}")
        name = f"user_task_{path.stem}"
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    else:
        importlib.import_module(module)


# ----------------------------------------------------------------------------------------------------------
# Rows a loader skipped (an unreadable image, a malformed row): skipped, logged and counted, never fatal

_load_skips: list[Counter] = []  # the open count_load_skips() scopes, innermost last


def skip_row(reason: str, where: str, error: Exception | str, *, rows: int | None = None) -> None:
    """Called by a task loader that drops a row (``reason`` e.g. "broken_images"): logs it and counts it in
    every open ``count_load_skips()`` scope. ``rows``: the one line for that many rows of file ``where``
    (``rows_to_samples`` reports a file's skips so, once per reason: a 260k-row file with a bad column would
    log 260k lines), ``error`` saying why and where the first was."""
    log = logging.getLogger("vlm_grpo_ma.data")
    if rows is None:
        log.warning("skipping %s: %s", where, error)
    else:
        log.warning("%d row%s of %s skipped: %s", rows, "s"[: rows != 1], where, error)
    for counts in _load_skips:
        counts[reason] += 1 if rows is None else rows


@contextlib.contextmanager
def count_load_skips():
    """``with count_load_skips() as skipped: task.load(...)`` -> ``skipped["broken_images"]`` rows dropped."""
    counts = Counter()
    _load_skips.append(counts)
    try:
        yield counts
    finally:
        _load_skips.remove(counts)
