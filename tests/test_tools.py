"""The tool API (``task_api/tools.py``): the zoom crops the original image's pixels of the box in both coordinate
frames, and every hostile call comes back as a short ASCII error turn, never an exception."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo_ma.task_api import (
    ZOOM_TOOL,
    Completion,
    CoordinateFrame,
    Sample,
    ToolContext,
    ToolError,
    ToolResult,
)
from vlm_grpo_ma.task_api.tools import (
    MAX_CALL_CHARS,
    MAX_ERROR_CHARS,
    Tool,
    call_text,
    parse_tool_call,
    run_tool_call,
)

REPO = Path(__file__).resolve().parents[1]
ABSOLUTE, RELATIVE = CoordinateFrame.ABSOLUTE_INPUT, CoordinateFrame.RELATIVE_1000


def gradient(width=200, height=100) -> Image.Image:
    """Every pixel distinct: red is x, green is y, so a crop's pixels say where they came from."""
    image = Image.new("RGB", (width, height))
    image.putdata([(x, y, 7) for y in range(height) for x in range(width)])
    return image


def context(image, frame=RELATIVE, input_size=None) -> ToolContext:
    size = image.size if isinstance(image, Image.Image) else Image.open(image).size
    return ToolContext((image,), (input_size or size,), (size,), frame)


def zoom(arguments, ctx: ToolContext) -> ToolResult:
    return run_tool_call((ZOOM_TOOL,), json.dumps({"name": "image_zoom_in_tool", "arguments": arguments}), ctx)


def assert_error_turn(result: ToolResult, says: str) -> None:
    assert result.error and result.images == () and result.boxes == ()
    assert result.text.startswith("Error: ") and says in result.text, result.text
    assert result.text.isascii() and len(result.text) <= MAX_ERROR_CHARS, result.text


# ---------------------------------------------------------------------------------------------------------------
# The crop is the original image's pixels of the box


@pytest.mark.parametrize(
    "frame, input_size, box",
    [
        (ABSOLUTE, (100, 50), [10, 15, 30, 35]),  # the model saw the image at half size
        (RELATIVE, None, [100, 300, 300, 700]),  # 0..1000 of each side
    ],
)
def test_the_crop_is_the_original_pixels_of_the_box_in_either_frame(tmp_path, frame, input_size, box):
    original = gradient()
    original.paste((255, 0, 255), (30, 40, 50, 60))  # a patch inside the box, for the eye
    path = tmp_path / "scene.png"
    original.save(path)
    result = zoom({"bbox_2d": box}, context(str(path), frame, input_size))
    assert not result.error, result.text
    (crop,) = result.images
    assert crop.size == (40, 40) and result.boxes == ((20.0, 30.0, 60.0, 70.0),)
    assert crop.tobytes() == original.crop((20, 30, 60, 70)).tobytes()
    assert crop.getpixel((10, 10)) == (255, 0, 255) and crop.getpixel((0, 0)) == (20, 30, 7)


def test_a_box_partly_outside_is_clipped_to_the_image_and_served():
    original = gradient()
    result = zoom({"bbox_2d": [-100, -100, 300, 300]}, context(original))  # [-20, -10, 60, 30] in pixels
    assert not result.error, result.text
    assert result.boxes == ((0.0, 0.0, 60.0, 30.0),)
    assert result.images[0].tobytes() == original.crop((0, 0, 60, 30)).tobytes()


def test_image_index_picks_the_image_and_its_own_sizes():
    first, second = Image.new("RGB", (100, 100), (1, 2, 3)), gradient()
    ctx = ToolContext((first, second), ((100, 100), (100, 50)), ((100, 100), (200, 100)), ABSOLUTE)
    result = zoom({"bbox_2d": [10, 15, 30, 35], "image_index": 1}, ctx)
    assert result.boxes == ((20.0, 30.0, 60.0, 70.0),)
    assert result.images[0].tobytes() == second.crop((20, 30, 60, 70)).tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Hostile calls: an error turn that says why, short and ASCII

ZOOM = '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": %s}}'
THIN_SCENE = context(Image.new("RGB", (1000, 500)))  # big enough for a crop 8 pixels high and 1000 wide


@pytest.mark.parametrize(
    "text, says",
    [
        (ZOOM % "[0, 0, 1e308, 1e308]", "reaches far outside the image (x from 0 to 1000, y from 0 to 1000)"),
        (ZOOM % "[-1e308, 0, 500, 500]", "reaches far outside"),
        (ZOOM % "[0, 0, 2100, 500]", "reaches far outside"),  # more than one image side past the edge
        (ZOOM % "[0, 0, 1e400, 500]", "not a finite number"),  # json reads 1e400 as inf
        (ZOOM % f"[0, 0, {'9' * 1500}, 500]", "not a finite number"),  # an integer float() cannot hold
        (ZOOM % "[NaN, 0, 500, 500]", "not a finite number"),  # json.loads accepts NaN and Infinity
        (ZOOM % "[0, 0, Infinity, 500]", "not a finite number"),
        (ZOOM % "[-Infinity, 0, 500, 500]", "not a finite number"),
        (ZOOM % "[500, 0, 100, 500]", "x1 < x2 and y1 < y2"),
        (ZOOM % "[0, 500, 500, 100]", "x1 < x2 and y1 < y2"),
        (ZOOM % "[300, 0, 300, 500]", "x1 < x2 and y1 < y2"),  # zero width
        (ZOOM % "[-900, -900, -100, -100]", "lies outside the image (x from 0 to 1000, y from 0 to 1000)"),
        (ZOOM % "[1000, 0, 1500, 500]", "lies outside the image"),
        (ZOOM % "[0, 0, 5, 5]", "too small"),  # 5 x 2.5 original pixels
        (ZOOM % "[0, 0, 1000, 16]", "too thin"),  # 1000 x 8 pixels
        (ZOOM % "[true, 0, 500, 500]", "list of 4 numbers"),
        (ZOOM % '["0", "0", "500", "500"]', "list of 4 numbers"),
        (ZOOM % '"0, 0, 500, 500"', "list of 4 numbers"),
        (ZOOM % "[[0, 0], [500, 500]]", "list of 4 numbers"),
        (ZOOM % "[[0], [0], [500], [500]]", "list of 4 numbers"),
        (ZOOM % "[0, 0, 500]", "list of 4 numbers"),
        (ZOOM % "null", "list of 4 numbers"),
        ('{"name": "image_zoom_in_tool", "arguments": {}}', "list of 4 numbers"),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500], "image_index": 1}}',
         "image_index must be an integer from 0 to 0"),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500], "image_index": -1}}', "image_index"),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500], "image_index": false}}', "image_index"),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500], "image_index": "0"}}', "image_index"),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500], "image_index": 0.0}}', "image_index"),
        ("[" * 100_000, f"at most {MAX_CALL_CHARS}"),
        # nested as deep as the length allows: parsed, or a RecursionError (the depth Python allows varies)
        ('{"name": "image_zoom_in_tool", "arguments": ' + "[" * 970 + "]" * 970 + "}", "Error: the call"),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2', "not valid JSON"),
        ('{"name": 5, "arguments": {}}', 'must be {"name": ..., "arguments": {...}}'),
        ('{"arguments": {}}', 'must be {"name": ..., "arguments": {...}}'),
        ('{"name": "crop", "arguments": {}}', "unknown tool 'crop'; the tools are: image_zoom_in_tool"),
        ('{"name": "image_zoom_in_tool", "arguments": [0, 0, 500, 500]}', "arguments must be an object"),
        ('{"name": "image_zoom_in_tool", "arguments": null}', "arguments must be an object"),
        ('{"name": "image_zoom_in_tool", "arguments": "{bbox_2d"}', "arguments are not valid JSON"),
        ("<function=image_zoom_in_tool><parameter=bbox_2d>garbage</parameter></function>", "list of 4 numbers"),
        ("<function=image_zoom_in_tool><parameter=bbox_2d>[NaN, 0, 1, 1]</parameter></function>", "finite"),
        ("<function=image_zoom_in_tool><parameter=bbox_2d>[0, 0, 500" + "<parameter=" * 150, "neither"),
        ("zoom in please", "neither"),
        ("", "neither"),
    ],
)
def test_a_hostile_call_is_an_error_turn_that_says_why(text, says):
    assert_error_turn(run_tool_call((ZOOM_TOOL,), text, THIN_SCENE), says)


def test_model_text_echoed_in_an_error_is_short_and_ascii():
    """An unknown name is quoted back cut to 64 characters, non-ASCII (a lone surrogate too) escaped."""
    name = "zo\u00f6m\ud800" * 100
    result = run_tool_call((ZOOM_TOOL,), json.dumps({"name": name, "arguments": {}}), THIN_SCENE)
    assert_error_turn(result, "unknown tool 'zo\\xf6m\\ud800zo")
    quoted = re.search(r"unknown tool (.*); the tools are", result.text).group(1)
    assert len(quoted) <= 64
    result = run_tool_call((ZOOM_TOOL,), "<function=" + "\u00e9" * 64 + "></function>", THIN_SCENE)
    assert_error_turn(result, "unknown tool '\\xe9")


def test_an_unreadable_image_is_an_error_turn(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    for path in (broken, tmp_path / "missing.png"):
        ctx = ToolContext((str(path),), ((100, 100),), ((100, 100),), ABSOLUTE)
        assert_error_turn(zoom({"bbox_2d": [0, 0, 50, 50]}, ctx), "the image could not be read")


def test_the_box_is_checked_before_any_pixel_is_read(tmp_path):
    """A refused box never opens the image: a missing file says "too small", not "could not be read"."""
    ctx = ToolContext((str(tmp_path / "missing.png"),), ((100, 100),), ((100, 100),), ABSOLUTE)
    assert_error_turn(zoom({"bbox_2d": [0, 0, 4, 4]}, ctx), "too small")


def test_a_tool_that_raises_or_returns_nonsense_is_an_error_turn():
    def tool(run) -> tuple[Tool]:
        return (Tool("t", "a test tool", {"type": "object"}, run),)

    def boom(arguments, ctx):
        raise RuntimeError("x" * 10_000)

    def loop(arguments, ctx):
        return loop(arguments, ctx)

    def refuse(arguments, ctx):
        raise ToolError("no \u00e9" + "y" * 10_000)

    call = '{"name": "t", "arguments": {}}'
    assert_error_turn(run_tool_call(tool(boom), call, THIN_SCENE), "the tool failed (RuntimeError)")
    assert_error_turn(run_tool_call(tool(loop), call, THIN_SCENE), "the tool failed (RecursionError)")
    assert_error_turn(run_tool_call(tool(lambda a, c: None), call, THIN_SCENE), "tool 't' returned no result")
    assert_error_turn(run_tool_call(tool(lambda a, c: "a crop"), call, THIN_SCENE), "returned no result")
    assert_error_turn(run_tool_call(tool(refuse), call, THIN_SCENE), "Error: no ?yyy")  # cut and ASCII
    assert run_tool_call(tool(lambda a, c: ToolResult(text="ok")), call, THIN_SCENE) == ToolResult(text="ok")


# ---------------------------------------------------------------------------------------------------------------
# Finding and parsing the call


def test_call_text_is_the_last_complete_call():
    assert call_text('a <tool_call>{"n": 1}</tool_call> b <tool_call>{"n": 2}</tool_call>') == '{"n": 2}'
    assert call_text("<tool_call>{} no close") is None
    assert call_text("no open {}</tool_call>") is None


def test_both_call_forms_parse_to_the_same_call():
    json_form = '\n{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4], "image_index": 0}}\n'
    string_arguments = '{"name": "image_zoom_in_tool", "arguments": "{\\"bbox_2d\\": [1, 2, 3, 4], \\"image_index\\": 0}"}'
    xml_form = ("\n<function=image_zoom_in_tool>\n<parameter=bbox_2d>\n[1, 2, 3, 4]\n</parameter>\n"
                "<parameter=image_index>\n0\n</parameter>\n</function>\n")
    calls = [parse_tool_call(text) for text in (json_form, string_arguments, xml_form)]
    assert all(call.name == "image_zoom_in_tool" for call in calls)
    assert all(call.arguments == {"bbox_2d": [1, 2, 3, 4], "image_index": 0} for call in calls)
    assert ZOOM_TOOL.schema()["function"]["name"] == "image_zoom_in_tool"


# ---------------------------------------------------------------------------------------------------------------
# docs/TASKS.md's example, run as written


def test_the_guide_tool_example_measures_refuses_and_pays_for_looking_when_right(tmp_path, fresh_registry):
    guide = (REPO / "docs" / "TASKS.md").read_text()
    code = re.search(r"## Tools: letting the thought look again\n.*?```python\n(.*?)```", guide, re.S).group(1)
    path = tmp_path / "distance_task.py"
    path.write_text(code)
    module = runpy.run_path(str(path))
    tools, ctx = module["TASK"].tools, context(Image.new("RGB", (1000, 500)))
    assert run_tool_call(tools, '{"name": "ruler", "arguments": {"points": [0, 0, 300, 800]}}', ctx) == ToolResult(
        text="500 pixels apart")  # 0..1000 of a 1000 x 500 image: (300, 400) pixels
    assert_error_turn(run_tool_call(tools, '{"name": "ruler", "arguments": {"points": [0, NaN, 1, 1]}}', ctx),
                      "points must be [x1, y1, x2, y2], four numbers")
    sample = Sample("distance", "0", "How far apart?", (), 500.0)

    def score(answer, tool_images):
        return module["reward"](Completion("<think>x</think>", f"<answer>{answer}</answer>", tool_images=tool_images),
                                sample)["reward"]

    assert score(500, 1) > score(500, 0) > score(90, 1) == score(90, 0) == 0.0
