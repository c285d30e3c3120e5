"""Tools a thought can call: the public declaration (``Tool``, ``ToolResult``, ``ToolContext``), the parser of a
call as Qwen's chat templates write it, and the built-in ``image_zoom_in_tool``.

A call is the text between ``<tool_call>`` and ``</tool_call>`` in the model's thought, either JSON
(``{"name": ..., "arguments": {...}}``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or Qwen3.5's XML
(``<function=NAME><parameter=KEY>VALUE</parameter></function>``). ``run_tool_call`` never raises: a call that
cannot be served (unparseable, an unknown tool, arguments the tool refuses, a tool that raised, a broken image)
gives an error ``ToolResult`` whose text tells the model why, and the thought goes on.

Everything here is total on model output and bounded: a call longer than ``MAX_CALL_CHARS`` is refused before
it is parsed, JSON nesting is bounded by the length, and a crop's size is checked before any pixel is read.
An error turn is short ASCII (``MAX_ERROR_CHARS``) and quotes at most ``ECHO_CHARS`` of the model's text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlm_grpo_ma.task_api.coords import CoordinateFrame, Size, from_original_pixels, to_original_pixels
from vlm_grpo_ma.task_api.images import ImageLoadError, decode_image

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# A call's text past this many characters is refused unread (a zoom call is about 90)
MAX_CALL_CHARS = 2_000
# An error turn is cut to this many characters, and model text quoted in it to ECHO_CHARS: the model reads the
# turn, and echoing a hostile call back would grow its context
MAX_ERROR_CHARS = 200
ECHO_CHARS = 64


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns: text and/or images (PIL), shown to the model as the next turn. ``error``: the call
    could not be served; ``text`` says why (counted as an invalid call)."""

    text: str = ""
    images: tuple = ()
    error: bool = False
    # where each returned image came from, in original pixels of the prompt's image [x1, y1, x2, y2] (for the
    # rollout records and drawings); empty for a tool whose images are not crops
    boxes: tuple[tuple[float, float, float, float], ...] = ()


@dataclass(frozen=True)
class ToolContext:
    """What a tool may read: the prompt's images (paths or PIL images, as the Sample holds them), the sizes the
    model saw them at and their original sizes, and the model's coordinate frame."""

    images: tuple
    input_sizes: tuple[Size, ...]
    original_sizes: tuple[Size, ...]
    frame: CoordinateFrame

    def to_original_pixels(self, values: Sequence[float], image_index: int = 0) -> list[float]:
        """Model-frame ``[x, y, ...]`` -> pixels of original image ``image_index`` (the one conversion)."""
        return to_original_pixels(values, self.frame, self.input_sizes[image_index], self.original_sizes[image_index])

    def from_original_pixels(self, values: Sequence[float], image_index: int = 0) -> list[float]:
        """Pixels of original image ``image_index`` -> the model's frame (a target writing a call, the warm start)."""
        return from_original_pixels(values, self.frame, self.input_sizes[image_index], self.original_sizes[image_index])


ToolFn = Callable[[Mapping[str, Any], ToolContext], ToolResult]


@dataclass(frozen=True)
class Tool:
    """A tool a task declares (``Task.tools``). ``parameters`` is the JSON schema of its arguments, shown to the
    model through the chat template's tool declaration; ``run(arguments, context)`` serves a call. ``run`` may
    raise ``ToolError`` (or anything else): the model gets an error turn and the call is counted invalid."""

    name: str
    description: str
    parameters: dict
    run: ToolFn

    def schema(self) -> dict:
        """The OpenAI-style function declaration Qwen's chat templates render (``tools=[...]``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class ToolError(ValueError):
    """A call a tool refuses; its message is what the model reads."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


_XML_FUNCTION = re.compile(r"<function=([^>\n]{1,64})>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]{1,64})>(.*?)</parameter>", re.DOTALL)


def _echo(text: str) -> str:
    """Model text quoted in an error turn: ASCII (escapes for the rest, lone surrogates included, which no
    tokenizer can encode) and at most ``ECHO_CHARS`` characters."""
    quoted = ascii(text)
    return quoted if len(quoted) <= ECHO_CHARS else quoted[: ECHO_CHARS - 3] + "..."


def _error_turn(message: str) -> ToolResult:
    """The error turn the model reads: ASCII, at most ``MAX_ERROR_CHARS`` characters (a task's own ``ToolError``
    may say anything)."""
    text = "Error: " + message.encode("ascii", "replace").decode("ascii")
    return ToolResult(text=text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "...", error=True)


def call_text(thought: str) -> str | None:
    """The text of the last complete ``<tool_call>...</tool_call>`` at the end of ``thought``, or None."""
    end = thought.rfind(TOOL_CALL_CLOSE)
    if end < 0:
        return None
    start = thought.rfind(TOOL_CALL_OPEN, 0, end)
    if start < 0:
        return None
    return thought[start + len(TOOL_CALL_OPEN) : end]


def parse_tool_call(text: str) -> ToolCall:
    """``text`` (what lies between the call tags) -> ToolCall; ToolError naming what is wrong."""
    if len(text) > MAX_CALL_CHARS:
        raise ToolError(f"the call is {len(text)} characters long; at most {MAX_CALL_CHARS}")
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except (ValueError, RecursionError) as error:
            raise ToolError(f"the call is not valid JSON ({type(error).__name__})") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ToolError('the call must be {"name": ..., "arguments": {...}}')
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise ToolError("the call's arguments are not valid JSON") from None
        if not isinstance(arguments, dict):
            raise ToolError("the call's arguments must be an object")
        return ToolCall(data["name"], arguments)
    function = _XML_FUNCTION.search(stripped)
    if function is None:
        raise ToolError('the call is neither {"name": ..., "arguments": {...}} nor <function=NAME>...</function>')
    arguments = {}
    for key, raw in _XML_PARAMETER.findall(function.group(2)):
        raw = raw.strip()
        try:
            arguments[key.strip()] = json.loads(raw)
        except (ValueError, RecursionError):
            arguments[key.strip()] = raw
    return ToolCall(function.group(1).strip(), arguments)


def run_tool_call(tools: Sequence[Tool], text: str, context: ToolContext) -> ToolResult:
    """Serve the call ``text`` with one of ``tools``; never raises (an error turn instead)."""
    try:
        call = parse_tool_call(text)
        by_name = {tool.name: tool for tool in tools}
        if call.name not in by_name:
            names = ", ".join(sorted(by_name)) or "none"
            raise ToolError(f"unknown tool {_echo(call.name)}; the tools are: {names}")
        result = by_name[call.name].run(call.arguments, context)
        if not isinstance(result, ToolResult):
            raise ToolError(f"tool {_echo(call.name)} returned no result")
        return result
    except ToolError as error:
        return _error_turn(str(error))
    except ImageLoadError:
        return _error_turn("the image could not be read")
    except Exception as error:  # a tool's own bug: the thought goes on, the call is counted invalid
        return _error_turn(f"the tool failed ({type(error).__name__})")


# ----------------------------------------------------------------------------------------------------------
# The built-in zoom tool (DeepEyes, Mini-o3, Qwen's own agent examples call it this way)

# The smallest crop side, in original pixels: below it a crop holds less than one vision patch of detail
MIN_CROP_SIDE = 8
# Qwen's processors refuse an aspect ratio of 200 or more; thinner than this is no region worth a look
MAX_CROP_ASPECT = 50
# A box may reach this many image sides past an edge (clipped there); farther, it is no box on this image (1e308,
# or a box in another coordinate frame) and is refused rather than served as the whole image
MAX_OVERHANG = 1.0


def _box_argument(arguments: Mapping[str, Any]) -> list[float]:
    box = arguments.get("bbox_2d")
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        raise ToolError("bbox_2d must be a list of 4 numbers [x1, y1, x2, y2]")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box):
        raise ToolError("bbox_2d must be a list of 4 numbers [x1, y1, x2, y2]")
    try:
        values = [float(v) for v in box]  # an integer of hundreds of digits overflows here
    except OverflowError:
        values = [math.inf]
    if not all(math.isfinite(v) for v in values):
        raise ToolError("bbox_2d holds a value that is not a finite number")
    return values


def zoom_in(arguments: Mapping[str, Any], context: ToolContext) -> ToolResult:
    """Crop ``bbox_2d`` (the model's frame on the image as it saw it) out of the original image ``image_index``
    (default 0). The crop goes to the model at its own resolution, under the processor's image budget."""
    if not context.images:
        raise ToolError("this prompt has no image to zoom into")
    index = arguments.get("image_index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(context.images):
        raise ToolError(f"image_index must be an integer from 0 to {len(context.images) - 1}")
    x1, y1, x2, y2 = _box_argument(arguments)
    if x2 <= x1 or y2 <= y1:
        raise ToolError("bbox_2d must have x1 < x2 and y1 < y2")
    width, height = context.original_sizes[index]
    left, top, right, bottom = context.to_original_pixels([x1, y1, x2, y2], index)
    # the image's extent in the model's frame, for the error turns: where a box may lie
    frame_w, frame_h = from_original_pixels([width, height], context.frame, context.input_sizes[index], (width, height))
    extent = f"x from 0 to {round(frame_w)}, y from 0 to {round(frame_h)}"
    reach_x, reach_y = MAX_OVERHANG * width, MAX_OVERHANG * height
    if left < -reach_x or top < -reach_y or right > width + reach_x or bottom > height + reach_y:
        raise ToolError(f"bbox_2d reaches far outside the image ({extent})")
    left, top, right, bottom = max(left, 0.0), max(top, 0.0), min(right, float(width)), min(bottom, float(height))
    if right <= left or bottom <= top:
        raise ToolError(f"bbox_2d lies outside the image ({extent})")
    crop_w, crop_h = right - left, bottom - top
    if min(crop_w, crop_h) < MIN_CROP_SIDE:
        raise ToolError("bbox_2d is too small to zoom into")
    if max(crop_w, crop_h) / min(crop_w, crop_h) > MAX_CROP_ASPECT:
        raise ToolError("bbox_2d is too thin to zoom into")
    image = decode_image(context.images[index])
    box = (math.floor(left), math.floor(top), math.ceil(right), math.ceil(bottom))
    return ToolResult(text="", images=(image.crop(box),), boxes=(tuple(float(v) for v in box),))


ZOOM_TOOL = Tool(
    name="image_zoom_in_tool",
    description="Zoom in on a region of the image: returns that region at full resolution.",
    parameters={
        "type": "object",
        "properties": {
            "bbox_2d": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                        "description": "the region [x1, y1, x2, y2] in the coordinates you use for boxes"},
            "image_index": {"type": "integer", "description": "which image (default 0)"},
        },
        "required": ["bbox_2d"],
    },  # fmt: skip
    run=zoom_in,
)

