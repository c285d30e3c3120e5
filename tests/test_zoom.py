"""The zoom task: the embedded generator (reproducible, the colour diluted at the model's resolution and solid in a
crop), the reward table (tool bonus only on a right answer that looked), the V* Bench and HR-Bench loaders."""

import base64
import csv
import importlib.util
import io
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw

from tasks import zoom
from vlm_grpo_ma.task_api import ZOOM_TOOL
from vlm_grpo_ma.task_api.registry import Completion, Sample, count_load_skips, get_task, load_samples

EXACT = 1e-12
REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "zoom"


def _load_generator():
    if "make_zoom" not in sys.modules:
        spec = importlib.util.spec_from_file_location("make_zoom", REPO / "data" / "make_zoom.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["make_zoom"]


make_zoom = _load_generator()


# ---------------------------------------------------------------------------------------------- generator


def test_generator_is_seeded_and_the_committed_split_is_its_output(tmp_path):
    first = make_zoom.generate(tmp_path / "a", 3, seed=11, split="train")
    second = make_zoom.generate(tmp_path / "b", 3, seed=11, split="train")
    other = make_zoom.generate(tmp_path / "c", 3, seed=12, split="train")
    assert first == second and first != other
    for row in first:
        assert (tmp_path / "a" / row["image"]).read_bytes() == (tmp_path / "b" / row["image"]).read_bytes()
    # the committed test split starts with what its seed generates (a smaller n gives a prefix)
    n, seed = make_zoom.SPLIT_SIZES_AND_SEEDS["test"]
    rows = make_zoom.generate(tmp_path / "d", 2, seed=seed, split="test")
    committed = [
        json.loads(line) for line in (REPO / "data" / "zoom" / "test.jsonl").read_text().splitlines()
    ]
    assert len(committed) == n and committed[:2] == rows
    for row in rows:
        with (
            Image.open(tmp_path / "d" / row["image"]) as made,
            Image.open(REPO / "data" / "zoom" / row["image"]) as kept,
        ):
            assert made.convert("RGB").tobytes() == kept.convert("RGB").tobytes()


def test_scenes_hide_the_colour_at_the_model_resolution_and_show_it_in_a_crop(tmp_path):
    rows = make_zoom.generate(tmp_path, 4, seed=5, split="train")
    for row in rows:
        assert row["answer"] in make_zoom.COLOURS and row["question"] == make_zoom.QUESTION
        frame, target = row["frame_box"], row["target_box"]
        side = frame[2] - frame[0]
        assert make_zoom.FRAME_SIDES[0] <= side <= make_zoom.FRAME_SIDES[1] and frame[3] - frame[1] == side
        inset = make_zoom.FRAME_STROKE
        assert frame[0] + inset < target[0] and target[2] < frame[2] - inset  # inside the frame's interior
        assert frame[1] + inset < target[1] and target[3] < frame[3] - inset
        assert max(target[2] - target[0], target[3] - target[1]) <= make_zoom.TARGET_SIDES[1]
        with Image.open(tmp_path / row["image"]) as image:
            assert image.size == (make_zoom.IMAGE_SIZE, make_zoom.IMAGE_SIZE)
            measured = make_zoom.legibility(image, frame, row["answer"])
            # every colour appears equally often in the scene (the target included): counts tell nothing
            pixels = image.convert("RGB")
            counts = {name: _blobs(pixels, rgb) for name, rgb in make_zoom.COLOURS.items()}
        assert 0.0 < measured["low_res_share"] <= make_zoom.MAX_LOW_RES_SHARE
        assert measured["crop_pixels"] >= make_zoom.MIN_CROP_PIXELS
        assert len(set(counts.values())) == 1 and counts[row["answer"]] == row["distractors"] // 4 + 1


def _blobs(image, rgb) -> int:
    """Connected regions of exactly ``rgb`` (4-neighbour flood fill on a mask)."""
    mask = Image.fromarray((np.asarray(image) == rgb).all(axis=2).astype(np.uint8) * 255).copy()  # writable
    count = 0
    while (box := mask.getbbox()) is not None:
        x = next(x for x in range(box[0], box[2]) if mask.getpixel((x, box[1])))
        ImageDraw.floodfill(mask, (x, box[1]), 0)
        count += 1
    return count


def test_legibility_tells_a_readable_scene_from_a_hidden_one():
    """The check itself: a target filling the frame's interior is readable at 168x168 (the check fails it)."""
    image = Image.new("RGB", (672, 672), (240, 240, 240))
    pen = ImageDraw.Draw(image)
    pen.rectangle((100, 100, 219, 219), outline=make_zoom.FRAME_COLOUR, width=make_zoom.FRAME_STROKE)
    pen.rectangle((108, 108, 211, 211), fill=make_zoom.COLOURS["blue"])
    readable = make_zoom.legibility(image, (100, 100, 220, 220), "blue")
    assert readable["low_res_share"] == pytest.approx(1.0, abs=0.02)  # the interior is all target
    pen.rectangle((108, 108, 211, 211), fill=(240, 240, 240))
    pen.rectangle((150, 150, 161, 161), fill=make_zoom.COLOURS["blue"])
    pen.line((100, 180, 220, 180), fill=(200, 200, 200), width=3)  # grey clutter is background to the measure
    hidden = make_zoom.legibility(image, (100, 100, 220, 220), "blue")
    assert hidden["low_res_share"] == pytest.approx(
        144 / 104**2, abs=0.002
    )  # the target's area over the interior's
    assert hidden["crop_pixels"] == 144


# ---------------------------------------------------------------------------------------------- reward

FRAME, TARGET = [100.0, 100.0, 220.0, 220.0], [150.0, 150.0, 162.0, 162.0]


def _colour_sample() -> Sample:
    meta = {
        "kind": "short_answer",
        "precision": None,
        "source": "project",
        "frame_box": FRAME,
        "target_box": TARGET,
    }
    return Sample(
        task="zoom", id="s", question=make_zoom.QUESTION, images=("x.png",), answer="red", meta=meta
    )


def _choice_sample() -> Sample:
    choices = ("red", "blue", "green", "white")
    meta = {
        "kind": "multiple_choice",
        "precision": None,
        "choices": choices,
        "answer_text": "blue",
        "source": "vstar",
    }
    return Sample(
        task="zoom",
        id="m",
        question=zoom.question_with_choices("Colour?", choices),
        images=("x.png",),
        answer="B",
        meta=meta,
    )


CALL = '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [25, 25, 55, 55]}}</tool_call>'
# what the engine leaves in the thought after a served call: the tool's turn, between the think tags
TURN = (
    "<|im_end|>\n<|im_start|>user\n<tool_response><|vision_start|><|image_pad|><|vision_end|></tool_response>"
)


def _completion(text, images=0, boxes=()):
    cut = text.index("</think>") + len("</think>") if "</think>" in text else len(text)
    return Completion(
        thought=text[:cut], answer=text[cut:], tool_calls=images, tool_images=images, tool_boxes=boxes
    )


def _ok(inner, look=True):
    thought = (
        f"<think>the frame is top left {CALL}{TURN} a small red square</think>"
        if look
        else "<think>hm</think>"
    )
    return f"{thought}<answer>{inner}</answer>"


# (name, sample, text, tool images, crop boxes, accuracy, format, crop_hit or None)
REWARD_TABLE = [
    ("right, looked", _colour_sample, _ok("red"), 1, (tuple(FRAME),), 1, 1, 1),
    ("right, capitalised with period", _colour_sample, _ok(" Red. "), 1, (tuple(FRAME),), 1, 1, 1),
    ("right, did not look", _colour_sample, _ok("red", look=False), 0, (), 1, 1, 0),
    ("right, call refused (no image came back)", _colour_sample, _ok("red"), 0, (), 1, 1, 0),
    ("right, looked elsewhere", _colour_sample, _ok("red"), 1, ((300.0, 300.0, 400.0, 400.0),), 1, 1, 0),
    ("wrong, looked", _colour_sample, _ok("blue"), 1, (tuple(FRAME),), 0, 1, 1),
    ("hedged: two colours", _colour_sample, _ok("red or blue"), 1, (tuple(FRAME),), 0, 1, 1),
    ("hedged: every colour", _colour_sample, _ok("red, green, blue, yellow"), 1, (), 0, 1, 0),
    ("colour with a noun", _colour_sample, _ok("red square"), 1, (), 0, 1, 0),
    ("blank answer", _colour_sample, _ok("  "), 1, (), 0, 0, 0),
    ("no tags", _colour_sample, "red", 1, (), 0, 0, 0),
    ("no think", _colour_sample, "<answer>red</answer>", 1, (), 1, 0, 0),
    ("text after the answer", _colour_sample, _ok("red") + " done", 1, (), 1, 0, 0),
    ("two answers", _colour_sample, _ok("red") + "<answer>red</answer>", 1, (), 0, 0, 0),
    ("cut off answer", _colour_sample, "<think>x</think><answer>red", 1, (), 0, 0, 0),
    ("letter", _choice_sample, _ok("B"), 1, (), 1, 1, None),
    ("option text", _choice_sample, _ok("blue"), 1, (), 1, 1, None),
    ("labelled option", _choice_sample, _ok("(B) blue"), 0, (), 1, 1, None),
    ("wrong letter", _choice_sample, _ok("A"), 1, (), 0, 1, None),
    ("every letter", _choice_sample, _ok("A B C D"), 1, (), 0, 1, None),
    ("two letters", _choice_sample, _ok("B or C"), 1, (), 0, 1, None),
    ("label and other text", _choice_sample, _ok("B. red"), 1, (), 0, 1, None),
]


@pytest.mark.parametrize(
    "name, make, text, images, boxes, accuracy, format_ok, crop_hit",
    REWARD_TABLE,
    ids=[r[0] for r in REWARD_TABLE],
)
def test_reward_table(name, make, text, images, boxes, accuracy, format_ok, crop_hit):
    parts = zoom.reward(_completion(text, images, boxes), make())
    looked = float(images > 0)
    tool = accuracy * looked
    expected = {"accuracy": accuracy, "format": format_ok, "tool": tool, "looked": looked,
                "reward": accuracy + 0.5 * format_ok + 0.5 * tool}  # fmt: skip
    if crop_hit is not None:
        expected["crop_hit"] = crop_hit
    assert set(parts) == set(expected)
    for part, value in expected.items():
        assert parts[part] == pytest.approx(value, abs=EXACT, rel=0), part


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<answer>" * 3,
        "<think><answer></think></answer>",
        "\x00" * 50,
        "<answer>" + "A " * 5000 + "</answer>",
    ],
)
def test_reward_never_raises_and_scores_malformed_output_zero(text):
    parts = zoom.reward(_completion(text, 2), _choice_sample())
    assert parts["accuracy"] == parts["tool"] == parts["reward"] == 0.0 and parts["looked"] == 1.0


def test_task_declares_the_zoom_tool_and_parses_and_draws_the_crops():
    task = get_task("zoom")
    assert (
        task.tools == (ZOOM_TOOL,)
        and "image_zoom_in_tool" in task.instruction
        and "<answer>" in task.instruction
    )
    assert task.success == "accuracy" and task.reward_weights == {"accuracy": 1.0, "format": 0.5, "tool": 0.5}
    assert {"accuracy", "tool", "looked"} <= set(task.metrics)
    sample = _colour_sample()
    parsed = task.parse(_completion(_ok("red"), 1, ((10.0, 20.0, 110.0, 120.0),)), sample)
    assert (
        parsed == {"answer": "red", "crop_boxes": [[10.0, 20.0, 110.0, 120.0]]}
        and json.loads(json.dumps(parsed)) == parsed
    )
    assert task.parse(_completion("no tags"), sample) == {"answer": None, "crop_boxes": []}
    drawn = task.draw(Image.new("RGB", (672, 672), (255, 255, 255)), sample, parsed)
    assert drawn.getpixel((100, 160)) == (40, 200, 60)  # the frame's left edge, in the truth colour
    assert drawn.getpixel((10, 70)) == (230, 40, 40)  # the crop's left edge, in the prediction colour
    assert task.draw(Image.new("RGB", (8, 8)), _choice_sample(), None).size == (336, 336)


# ---------------------------------------------------------------------------------------------- loading


def test_embedded_splits_load():
    samples = load_samples(get_task("zoom"), "test")
    assert len(samples) == make_zoom.SPLIT_SIZES_AND_SEEDS["test"][0]
    first = samples[0]
    assert first.question == make_zoom.QUESTION and first.answer in make_zoom.COLOURS
    assert (
        first.meta["kind"] == "short_answer"
        and len(first.meta["target_box"]) == 4
        and Path(first.images[0]).is_file()
    )
    with pytest.raises(ValueError, match="unknown zoom split 'dev'; embedded splits: train, test"):
        zoom.load("dev")


def test_vstar_loads_from_its_folder_its_file_and_the_parquet_copy():
    by_source = {
        source: zoom.load("test", str(FIXTURES / source))
        for source in ("vstar", "vstar/test_questions.jsonl", "vstar_lmms.parquet")
    }
    for samples in by_source.values():
        assert [s.id for s in samples] == ["0", "1", "2", "3"]
        assert [s.answer for s in samples] == ["B", "A", "B", "A"]
        first = samples[0]
        assert (
            first.question == "What is the colour of the cup?\nA. red\nB. blue\nC. green\nD. white"
        )  # no hint
        assert (
            first.meta["choices"] == ("red", "blue", "green", "white") and first.meta["answer_text"] == "blue"
        )
        assert first.meta["category"] == "direct_attributes" and samples[2].meta["choices"] == (
            "left",
            "right",
        )
    assert by_source["vstar"][2].images[0] == str(FIXTURES / "vstar" / "relative_position" / "sa_3.jpg")
    assert by_source["vstar_lmms.parquet"][0].images[0].size == (10, 8)


def test_hrbench_loads_from_parquet_and_tsv_alike():
    parquet, tsv = (
        zoom.load("test", str(FIXTURES / f"hr_bench_4k.{suffix}")) for suffix in ("parquet", "tsv")
    )
    for samples in (parquet, tsv):
        assert [s.id for s in samples] == ["0", "1", "2", "3"] and [s.answer for s in samples] == [
            "C",
            "B",
            "A",
            "D",
        ]
        assert (
            samples[0].question == 'What does the sign say after "open"?\nA. daily\nB. late\nC. now\nD. soon'
        )
        assert samples[1].meta["answer_text"] == samples[0].meta["answer_text"] == "now"
        assert (
            samples[2].meta["choices"] == ("3", "4", "5", "2")
            and samples[2].meta["cycle_category"] == "cycle_0"
        )
        assert samples[0].images[0] is samples[1].images[0]  # one image for the rotated copies of a question
        assert samples[0].images[0].size == (12, 8)
    assert [(s.question, s.meta) for s in parquet] == [(s.question, s.meta) for s in tsv]


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    rows = [
        json.loads(line) for line in (FIXTURES / "vstar" / "test_questions.jsonl").read_text().splitlines()
    ]
    rows[0]["label"] = "E"  # not an option
    rows[1]["text"] = "What is the material of the glove?"  # no options
    rows[2]["text"] = "Left or right?\n(A) left\n(B) \n(C) up"  # a blank option
    rows += [{**rows[3], "question_id": 4, "image": 5}, {**rows[3], "question_id": 5, "image": None}]  # no image
    source = tmp_path / "test_questions.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with count_load_skips() as skipped:
        samples = zoom.load("test", str(source))
    assert [s.id for s in samples] == ["3"] and skipped == {"malformed_rows": 5}

    rows = pq.read_table(FIXTURES / "hr_bench_4k.parquet").to_pylist()
    rows[0]["image"] = "not base64 at all!"
    rows[1]["answer"] = "A B"
    rows[2]["C"] = None  # options A, B, D: a letter skipped
    rows[3]["image"] = base64.b64encode(b"these bytes are no image").decode()
    rows.append(
        {
            **rows[3],
            "index": 4,
            "image": pq.read_table(FIXTURES / "hr_bench_4k.parquet").to_pylist()[0]["image"],
        }
    )
    source = tmp_path / "hr_bench_8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    with count_load_skips() as skipped:
        samples = zoom.load("test", str(source))
    assert [s.id for s in samples] == ["4"] and skipped == {"malformed_rows": 3, "broken_images": 1}

    # a TSV whose every row is bad (here its one row's answer is no option) is an error saying so
    source = tmp_path / "bad.tsv"
    with open(source, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(["index", "question", "answer", "A", "B", "image"])
        writer.writerow([0, "Which?", "C", "x", "y", base64.b64encode(_jpeg()).decode()])
    with pytest.raises(ValueError, match="every row was skipped"):
        zoom.load("test", str(source))


def _jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_bad_sources_fail_at_start_naming_what_is_valid(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"unknown zoom source format '\.csv'.*a folder or a file ending in \.jsonl, \.parquet, \.tsv",
    ):
        zoom.load("test", str(tmp_path / "x.csv"))
    with pytest.raises(FileNotFoundError, match="holds neither test_questions.jsonl"):
        zoom.load("test", str(tmp_path))
    (tmp_path / "other.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match="unrecognised zoom columns answer, question"):
        zoom.load("test", str(tmp_path / "other.jsonl"))
    (tmp_path / "broken.tsv").write_text('index\tquestion\n0\t"never closed\n')
    with pytest.raises(ValueError, match="broken.tsv"):
        zoom.load("test", str(tmp_path / "broken.tsv"))
