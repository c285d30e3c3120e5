"""The public API for task authors: everything a task file needs, and nothing here starts with an underscore.
It is also the task layer of the trainer (the layer above ``algorithm``; it imports nothing else of the
package): what a task is and the registry (``registry.py``), the parsers (``parsing.py``), drawings
(``drawing.py``), data readers (``sources.py``), coordinate frames (``coords.py``), images (``images.py``),
the reward workers (``reward_pool.py``) and the prompt streams a run draws from (``streams.py``).

A task is one module that builds a ``Task`` and registers it when imported::

    from vlm_grpo_ma.task_api import Completion, Sample, Task, extract_tag, has_think_answer_format, register_task

    def load(split="train", source=None) -> list[Sample]: ...
    def reward(completion: Completion, sample: Sample) -> dict[str, float]: ...   # {"reward": r, part: value}

    def target(sample: Sample) -> str: ...   # optional: "<think>...</think><answer>...</answer>" to imitate

    TASK = register_task(Task(name="mytask", load=load, reward=reward, instruction="Think in <think>...", target=target))

The core finds task modules through the ``vlm_grpo_ma.tasks`` entry point group (``name = "package.module"``
in the ``[project.entry-points."vlm_grpo_ma.tasks"]`` table of a package's pyproject.toml), or by the module
names and ``.py`` paths a config lists in ``data.task_modules``. docs/TASKS.md walks through an example.
A task with ``target`` can be warm-started by supervised training on its own data before RL
(``python -m vlm_grpo_ma.warmstart --task NAME``).

What is here:
  types         ``Sample``, ``Completion``, ``Task``, ``CoordinateFrame``;
  registration  ``register_task`` (duplicate names raise, naming both sources), ``get_task``, ``list_tasks``;
  rewards       ``weighted_reward``; the parsers ``extract_tag``, ``has_think_answer_format`` (the format check),
                ``parse_numbers``, ``parse_box``, ``parse_points``, ``normalise_answer``; the geometry
                ``order_corners``, ``clip_box``, ``iou``;
  loaders       ``checked_source_file``, ``require_keys``, ``jsonl_rows``, ``read_rows``, ``detect_schema``, ``rows_to_samples``,
                ``image_from_cell``, ``resolved_path`` (a row's file path, a NUL byte refused),
                ``embedded_split_file``, ``skip_row`` (drop a row with an unreadable image, counted), ``BadRow``
                (raised for a malformed row: ``rows_to_samples`` skips and counts it), ``ImageLoadError``,
                ``header_size``, ``open_lazily``;
  videos        ``decode_video`` (a path or frame list under a ``VideoBudget`` -> ``DecodedVideo``), ``FrameList``
                (a frame list with its frames' rate), ``VideoLoadError``
                (skipped and counted as a broken image is), ``frame_strip`` (frames side by side, for drawings);
  judge         ``JudgeQuery`` (what ``Task.judge_query`` returns: the run's served judge is asked it, and the
                reward reads the verdict as ``Completion.judgement``; docs/JUDGE.md);
  tools         ``Tool`` (what ``Task.tools`` lists: a thought may call it), ``ToolResult``, ``ToolContext``,
                ``ToolError`` (a call the tool refuses: the model reads an error turn), ``ZOOM_TOOL`` (the
                built-in zoom tool, image_zoom_in_tool; docs/TASKS.md, "Tools");
  evaluation    ``draw_marks`` with ``PREDICTION_COLOUR`` and ``TRUTH_COLOUR`` (for ``Task.draw``).

Every parser is total on model output: malformed text gives ``None`` (or ``0.0`` for ``iou``), never an
exception, so a reward can call them without a try/except. Boxes are ``[x1, y1, x2, y2]`` (top-left,
bottom-right); points are ``(x, y)``. The parsers know nothing about coordinate frames: rewards convert with
``Completion.to_original_pixels`` (the one conversion) and then use these helpers. Every parser runs in linear
time on any input (``tests/test_common.py`` times adversarial ones).
"""

from __future__ import annotations

from vlm_grpo_ma.task_api.coords import CoordinateFrame
from vlm_grpo_ma.task_api.drawing import PREDICTION_COLOUR, TRUTH_COLOUR, draw_marks
from vlm_grpo_ma.task_api.images import ImageLoadError, header_size, open_lazily
from vlm_grpo_ma.task_api.judge import JudgeQuery
from vlm_grpo_ma.task_api.parsing import (
    clip_box,
    extract_tag,
    has_think_answer_format,
    iou,
    normalise_answer,
    order_corners,
    parse_box,
    parse_numbers,
    parse_points,
    right_thought,
)
from vlm_grpo_ma.task_api.registry import (
    Completion,
    Sample,
    Task,
    get_task,
    list_tasks,
    register_task,
    skip_row,
    weighted_reward,
)
from vlm_grpo_ma.task_api.sources import (
    BadRow,
    checked_source_file,
    detect_schema,
    embedded_split_file,
    image_from_cell,
    jsonl_rows,
    read_rows,
    require_keys,
    resolved_path,
    rows_to_samples,
)
from vlm_grpo_ma.task_api.tools import ZOOM_TOOL, Tool, ToolContext, ToolError, ToolResult
from vlm_grpo_ma.task_api.videos import (
    DecodedVideo,
    FrameList,
    VideoBudget,
    VideoLoadError,
    decode_video,
    frame_strip,
)

__all__ = [
    # types
    "Sample",
    "Completion",
    "Task",
    "CoordinateFrame",
    # registration
    "register_task",
    "get_task",
    "list_tasks",
    # rewards
    "weighted_reward",
    "extract_tag",
    "has_think_answer_format",
    "right_thought",
    "parse_numbers",
    "parse_box",
    "parse_points",
    "normalise_answer",
    "order_corners",
    "clip_box",
    "iou",
    # loaders
    "checked_source_file",
    "embedded_split_file",
    "require_keys",
    "jsonl_rows",
    "read_rows",
    "detect_schema",
    "rows_to_samples",
    "image_from_cell",
    "resolved_path",
    "skip_row",
    "BadRow",
    "ImageLoadError",
    "header_size",
    "open_lazily",
    # judge
    "JudgeQuery",
    # tools
    "Tool",
    "ToolResult",
    "ToolContext",
    "ToolError",
    "ZOOM_TOOL",
    # videos
    "VideoLoadError",
    "VideoBudget",
    "DecodedVideo",
    "FrameList",
    "decode_video",
    "frame_strip",
    # evaluation
    "draw_marks",
    "PREDICTION_COLOUR",
    "TRUTH_COLOUR",
]
