"""Parsers of model output and the geometry rewards use: tags and the think/answer format, numbers, boxes,
points, answer normalisation, corners, clipping and IoU. Every parser is total on model output (malformed text
gives None, or 0.0 for ``iou``) and runs in linear time on any input."""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Sequence

# One number as a model writes it: optional sign, int or decimal, optional exponent, and the words
# nan/inf/infinity, which come out non-finite so that callers reject them rather than guess.
_NUMBER_CORE = r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf(?:inity)?)"

# In free text a number must not continue an identifier: the "2" of "bbox_2d" and the "1" of "x1" are
# not numbers (so "[x1, y1, x2, y2]" holds no numbers at all), and "nan"/"inf" must be whole words
# (not the start of "information").
_NUMBER_IN_TEXT = re.compile(
    r"(?<![A-Za-z0-9_.])"
    r"(?:[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)|[-+]?(?:nan|inf(?:inity)?)(?![A-Za-z0-9_]))",
    re.IGNORECASE,
)

# The inside of "[12, 30, 80, 95]" is read as tokens (a number, a comma, a whitespace run) matched one after
# another at increasing offsets, and checked by a small state machine in ``_group_numbers``. A single regex
# for "N numbers separated by commas/whitespace" (``\s*(?:,\s*|\s+)`` between numbers) can split a run of
# spaces in many ways and backtracked polynomially: three gaps of 150 spaces took 15 s, 1,000 never ended.
_GROUP_TOKEN = re.compile(rf"(?P<space>\s+)|(?P<comma>,)|(?P<number>{_NUMBER_CORE})", re.IGNORECASE)


def _group_numbers(group: str, size: int) -> list[float] | None:
    """The ``size`` numbers of ``group`` when it is exactly that: optional whitespace, numbers separated by
    whitespace and/or one comma, an optional trailing comma and whitespace. None otherwise. Linear time: each
    token is matched once at the offset where the previous one ended."""
    numbers: list[float] = []
    separated = False  # whitespace or a comma since the last number
    comma = False  # a comma since the last number
    position = 0
    while position < len(group):
        token = _GROUP_TOKEN.match(group, position)
        if token is None:
            return None
        position = token.end()
        if token.lastgroup == "space":
            separated = True
        elif token.lastgroup == "comma":
            if not numbers or comma:
                return None
            separated = comma = True
        else:
            if (numbers and not separated) or len(numbers) == size:
                return None
            numbers.append(float(token.group()))
            separated = comma = False
    return numbers if len(numbers) == size else None


# The innermost bracketed group: "[...]" or "(...)" holding no further brackets. Nested lists such as
# "[[1, 2], [3, 4]]" yield their inner groups.
_INNERMOST_GROUP = re.compile(r"[\[(]([^\[\]()]*)[\])]")

# A Markdown code fence around JSON, as Qwen2.5-VL writes grounding answers: ```json\n[...]\n```. Removed
# with string methods (``_unfenced``): the regex it replaces (```` \s*```[A-Za-z]*\s*(.*?)\s*```\s* ````)
# took 0.3 s on 1,000 spaces after an opening fence and did not finish on 10,000.
_FENCE_LANGUAGE = re.compile(r"[A-Za-z]*")

# Keys under which Qwen-VL style JSON carries a box or a point.
_BOX_KEYS = ("bbox_2d", "bbox", "box")
_POINT_KEYS = ("point_2d", "point")

_THINK_ANSWER = re.compile(r"\s*<think>.*</think>\s*<answer>.*</answer>\s*", re.DOTALL)

_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
# A period between two digits is a decimal point ("2.5"), which the VQA answer normalisation keeps.
_NON_DECIMAL_PERIOD = re.compile(r"(?<!\d)\.|\.(?!\d)")
_PUNCTUATION_BUT_PERIOD = str.maketrans("", "", string.punctuation.replace(".", ""))


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the one ``<tag>...</tag>`` in ``text`` (not stripped), or None.

    None when the tag is absent, unclosed (a truncated answer), closed before it opens, or appears more
    than once: with two answer tags there is no single answer to grade, so neither is picked.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    if text.count(opening) != 1 or text.count(closing) != 1:
        return None
    start = text.index(opening) + len(opening)
    end = text.index(closing)
    if end < start:
        return None
    return text[start:end]


def right_thought(text: str, reference_thought: str) -> bool:
    """Whether the think part of ``text`` is ``reference_thought``, compared word by word (spacing aside): on
    generated data, where the reference thought is the one right reasoning (grounding: the target and its
    place; counting: the picture's inventory), it tells a right thought from a wrong one."""
    thought = extract_tag(text, "think")
    return thought is not None and thought.split() == str(reference_thought).split()


def has_think_answer_format(text: str) -> bool:
    """True when the whole text is ``<think>...</think>`` then ``<answer>...</answer>``.

    Whitespace is allowed before, between and after; any other text outside the tags, or any of the four
    tags appearing other than exactly once, fails. Empty tag contents pass (the content is graded by the
    task's other reward parts).
    """
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        if text.count(tag) != 1:
            return False
    return _THINK_ANSWER.fullmatch(text) is not None


def parse_numbers(text: str) -> list[float]:
    """Every number written in ``text``, in order, as floats.

    Signs, decimals and exponents are read; ``nan``/``inf``/``infinity`` (any case, optionally signed) come
    out as non-finite floats so that callers reject them; overflowing literals such as ``1e999`` come out
    as ``inf``. Digits inside identifiers (``x1``, ``bbox_2d``) are not numbers.
    """
    return [float(match) for match in _NUMBER_IN_TEXT.findall(text)]


def _is_number(value: object) -> bool:
    # bool is an int subclass in Python; a JSON true/false is not a coordinate.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _as_float(value: int | float) -> float:
    # A JSON integer beyond float range (10**400) overflows float(); as a coordinate it is infinite.
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _unfenced(text: str) -> str:
    """The inside of a whole-text Markdown fence (```` ```json ... ``` ````, language tag and surrounding
    whitespace dropped), or ``text`` unchanged when it is not wholly fenced."""
    stripped = text.strip()
    if len(stripped) < 6 or not (stripped.startswith("```") and stripped.endswith("```")):
        return text
    inner = stripped[3:-3]
    return inner[_FENCE_LANGUAGE.match(inner).end() :].strip()


def _json_value(text: str) -> object | None:
    """``text`` (optionally inside a Markdown code fence) parsed as JSON, or None when it is not JSON."""
    text = _unfenced(text)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_items(value: object, keys: Sequence[str], size: int) -> list[list[float]] | None:
    """Coordinate lists of length ``size`` in a parsed JSON value, or None when it is not of that shape.

    Accepted shapes: ``[n, ...]``; ``{key: [n, ...]}`` for the first of ``keys`` present; and a list of
    either. The values are not checked for finiteness here.
    """

    def one(item: object) -> list[float] | None:
        if isinstance(item, dict):
            key = next((k for k in keys if k in item), None)
            item = item[key] if key is not None else None
        if isinstance(item, list) and len(item) == size and all(_is_number(v) for v in item):
            return [_as_float(v) for v in item]
        return None

    single = one(value)
    if single is not None:
        return [single]
    if isinstance(value, list) and value:
        items = [one(item) for item in value]
        if all(item is not None for item in items):
            return items
    return None


def _bracketed_items(text: str, size: int) -> list[list[float]] | None:
    """Coordinate lists of ``size`` numbers written as ``[...]``/``(...)`` groups or as bare numbers.

    Every innermost bracketed group that holds a number must be exactly ``size`` numbers separated by
    commas/whitespace, or the whole text fails (a group like ``[12, 30, eighty, 95]`` is not silently
    skipped). Groups without numbers (``(left)``) are ignored. With no bracketed number at all, the whole
    text must be exactly ``size`` bare numbers (``12, 30, 80, 95``).
    """
    groups = [group for group in _INNERMOST_GROUP.findall(text) if parse_numbers(group)]
    if not groups:
        groups = [text]
    items = []
    for group in groups:
        numbers = _group_numbers(group, size)
        if numbers is None:
            return None
        items.append(numbers)
    return items


def _coordinate_items(text: str, keys: Sequence[str], size: int) -> list[list[float]] | None:
    """All finite coordinate lists of ``size`` numbers in ``text``, or None if any is malformed/non-finite."""
    value = _json_value(text)
    # Text that is valid JSON is judged as JSON only: a JSON value of another shape (a bare number, a list
    # of 3) is not a box, and reading its digits as free text would be a guess.
    items = _json_items(value, keys, size) if value is not None else _bracketed_items(text, size)
    if not items or not all(math.isfinite(v) for item in items for v in item):
        return None
    return items


def parse_box(text: str) -> list[float] | None:
    """The one box ``[x1, y1, x2, y2]`` written in ``text``, or None.

    Accepted: ``[12, 30, 80, 95]``, ``(12,30,80,95)``, bare ``12, 30, 80, 95``, and Qwen2.5-VL JSON
    ``{"bbox_2d": [...]}`` / ``[{"bbox_2d": [...], "label": ...}]`` (optionally in a ```json fence).
    None for zero boxes, two or more boxes, a group that is not exactly 4 numbers, words in place of
    numbers, or any non-finite number. Corners are returned as written (not sorted, not clipped).
    """
    if not isinstance(text, str):
        return None
    items = _coordinate_items(text, _BOX_KEYS, 4)
    if items is None or len(items) != 1:
        return None
    return items[0]


def parse_points(text: str) -> list[tuple[float, float]] | None:
    """All points ``(x, y)`` written in ``text``, in order, or None.

    Accepted: ``(10, 20)``, ``[10, 20]``, ``[(10, 20), (30, 40)]``, ``[[10, 20], [30, 40]]``, bare ``10, 20``
    and JSON ``{"point_2d": [x, y]}`` or a list of those. None for no points, any bracketed group that is
    not exactly 2 numbers (a 4-number group is a box, not two points), or any non-finite number.
    """
    if not isinstance(text, str):
        return None
    items = _coordinate_items(text, _POINT_KEYS, 2)
    if items is None:
        return None
    return [(item[0], item[1]) for item in items]


def order_corners(box: Sequence[float]) -> list[float]:
    """``[x1, y1, x2, y2]`` with x1 <= x2 and y1 <= y2 (a box written bottom-right first is still that box)."""
    x1, y1, x2, y2 = (float(v) for v in box)
    return [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]


def clip_box(box: Sequence[float], width: float, height: float) -> list[float]:
    """Clamp a box's x into [0, width] and y into [0, height].

    Expects finite values (check ``coords.is_finite`` first); corners are clamped independently, not
    reordered, so sort them with ``order_corners`` first. A box wholly outside the image collapses to zero
    area on the border and then scores IoU 0.
    """
    x1, y1, x2, y2 = (float(v) for v in box)
    return [
        min(max(x1, 0.0), float(width)),
        min(max(y1, 0.0), float(height)),
        min(max(x2, 0.0), float(width)),
        min(max(y2, 0.0), float(height)),
    ]


def iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes, in [0, 1].

    Corners are sorted first. 0.0 when either box does not have 4 values, holds a non-finite value or has
    zero area, and when the arithmetic overflows (boxes near 1e308): a degenerate box matches nothing.
    """
    if len(box_a) != 4 or len(box_b) != 4:
        return 0.0
    a, b = order_corners(box_a), order_corners(box_b)
    if not all(math.isfinite(v) for v in a + b):
        return 0.0
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    if not (area_a > 0.0 and area_b > 0.0):
        return 0.0
    overlap_w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    overlap_h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    intersection = overlap_w * overlap_h
    value = intersection / (area_a + area_b - intersection)
    return value if math.isfinite(value) else 0.0


def normalise_answer(text: str) -> str:
    """A short free-form answer reduced for exact-match comparison (VQA, counting, multiple choice).

    Lowercased; punctuation deleted (SQuAD-style deletion rather than replacement by a space, so "1,000"
    -> "1000" and "don't" -> "dont") except a period between digits ("2.5" stays); the articles a/an/the
    dropped; whitespace collapsed to single spaces and stripped.
    """
    text = text.lower()
    text = _NON_DECIMAL_PERIOD.sub("", text)
    text = text.translate(_PUNCTUATION_BUT_PERIOD)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())
