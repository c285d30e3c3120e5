"""The grounding task: reward tables (malformed output included), coordinate frames, loaders, embedded data."""

import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tasks import grounding
from vlm_grpo_ma.task_api.coords import CoordinateFrame
from vlm_grpo_ma.task_api.registry import Completion, Sample, get_task

EXACT = 1e-9
REPO = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_grounding", REPO / "data" / "make_grounding.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


make_grounding = _load_generator()


def _sample(box=(20, 20, 60, 60), width=168, height=168) -> Sample:
    return Sample(
        task="grounding",
        id="s0",
        question="Locate: the red circle.",
        images=("unused.png",),
        answer=[float(v) for v in box],
        meta={"width": width, "height": height},
    )


def _completion(text, frame=CoordinateFrame.ABSOLUTE_INPUT, input_size=(168, 168), original_size=(168, 168)):
    # Split where the policy would: the thought runs up to and including "</think>".
    cut = text.index("</think>") + len("</think>") if "</think>" in text else len(text)
    return Completion(
        thought=text[:cut],
        answer=text[cut:],
        frame=frame,
        input_sizes=(input_size,),
        original_sizes=(original_size,),
    )


def _expected(iou, format_ok):
    return {
        "iou": iou,
        "format": float(format_ok),
        "acc_iou50": float(iou >= 0.5),
        "reward": 1.0 * iou + 0.5 * float(format_ok),
    }


def _assert_parts(parts, expected):
    assert set(parts) == set(expected)
    for name, value in expected.items():
        assert parts[name] == pytest.approx(value, abs=EXACT, rel=0), name


# Ground truth [20, 20, 60, 60] (area 1600) in a 168x168 image; model frame = original pixels.
T = "<think>the red circle is at the top left</think>"
REWARD_TABLE = [
    ("perfect", T + "<answer>[20, 20, 60, 60]</answer>", _expected(1.0, True)),
    ("whitespace around tags", "\n " + T + "\n<answer> [20,20,60,60] </answer>\n", _expected(1.0, True)),
    ("swapped corners", T + "<answer>[60, 60, 20, 20]</answer>", _expected(1.0, True)),
    ("mixed corners", T + "<answer>[60, 20, 20, 60]</answer>", _expected(1.0, True)),
    ("parentheses", T + "<answer>(20,20,60,60)</answer>", _expected(1.0, True)),
    (
        "qwen2.5-vl json",
        T + '<answer>```json\n[{"bbox_2d": [20, 20, 60, 60], "label": "the red circle"}]\n```</answer>',
        _expected(1.0, True),
    ),
    ("json dict", T + '<answer>{"bbox_2d": [20, 20, 60, 60]}</answer>', _expected(1.0, True)),
    ("half overlap", T + "<answer>[40, 20, 80, 60]</answer>", _expected(800 / 2400, True)),
    ("iou exactly 0.5", T + "<answer>[20, 20, 60, 100]</answer>", _expected(0.5, True)),
    ("float coordinates", T + "<answer>[20.5, 20, 60, 60]</answer>", _expected(1580 / 1600, True)),
    # negative corner clipped to the image: [0, 0, 40, 40] vs GT -> 400 / 2800
    ("negative numbers", T + "<answer>[-20, -20, 40, 40]</answer>", _expected(400 / 2800, True)),
    # huge box clipped to the whole image: GT area / image area
    ("huge numbers", T + "<answer>[0, 0, 100000, 100000]</answer>", _expected(1600 / 168**2, True)),
    ("box outside the image", T + "<answer>[200, 200, 300, 300]</answer>", _expected(0.0, True)),
    ("zero-area box", T + "<answer>[30, 30, 30, 50]</answer>", _expected(0.0, True)),
    # no single box in a single answer tag: nothing to grade
    ("no tags", "[20, 20, 60, 60]", _expected(0.0, False)),
    ("only think", "<think>[20, 20, 60, 60]</think>", _expected(0.0, False)),
    ("empty answer", T + "<answer></answer>", _expected(0.0, False)),
    ("truncated answer", T + "<answer>[20, 20, 60,", _expected(0.0, False)),
    ("two boxes", T + "<answer>[20, 20, 60, 60] [0, 0, 10, 10]</answer>", _expected(0.0, False)),
    (
        "two answer tags",
        T + "<answer>[20,20,60,60]</answer><answer>[20,20,60,60]</answer>",
        _expected(0.0, False),
    ),
    ("three numbers", T + "<answer>[20, 20, 60]</answer>", _expected(0.0, False)),
    ("nan", T + "<answer>[nan, 20, 60, 60]</answer>", _expected(0.0, False)),
    ("inf", T + "<answer>[20, 20, inf, 60]</answer>", _expected(0.0, False)),
    ("overflowing literal", T + "<answer>[20, 20, 1e999, 60]</answer>", _expected(0.0, False)),
    ("text instead of numbers", T + "<answer>[x1, y1, x2, y2]</answer>", _expected(0.0, False)),
    ("words only", T + "<answer>the red circle</answer>", _expected(0.0, False)),
    ("spelled numbers", T + "<answer>[twenty, 20, 60, 60]</answer>", _expected(0.0, False)),
    # a box in a single answer tag is graded, but the format part is lost
    ("answer without think", "<answer>[20, 20, 60, 60]</answer>", _expected(1.0, False)),
    ("extra text before", "Sure! " + T + "<answer>[20, 20, 60, 60]</answer>", _expected(1.0, False)),
    ("extra text after", T + "<answer>[20, 20, 60, 60]</answer> Done.", _expected(1.0, False)),
    ("two think tags", T + T + "<answer>[20, 20, 60, 60]</answer>", _expected(1.0, False)),
    ("empty", "", _expected(0.0, False)),
]


@pytest.mark.parametrize(
    ("text", "expected"), [row[1:] for row in REWARD_TABLE], ids=[r[0] for r in REWARD_TABLE]
)
def test_reward_table(text, expected):
    _assert_parts(grounding.reward(_completion(text), _sample()), expected)


# The same ground truth [20, 20, 60, 60] on a 168x168 original, written in different model frames.
FRAME_TABLE = [
    # Qwen2.5-VL saw the image resized to 84x84: its pixels are half the original's.
    ("absolute 84->168, converted", CoordinateFrame.ABSOLUTE_INPUT, (84, 84), "[10, 10, 30, 30]", 1.0),
    # the ground truth's own numbers read in the 84x84 frame become [40, 40, 120, 120]: 400 / 7600
    (
        "absolute 84->168, unconverted",
        CoordinateFrame.ABSOLUTE_INPUT,
        (84, 84),
        "[20, 20, 60, 60]",
        400 / 7600,
    ),
    ("absolute 336->168", CoordinateFrame.ABSOLUTE_INPUT, (336, 336), "[40, 40, 120, 120]", 1.0),
    ("absolute, non-square input", CoordinateFrame.ABSOLUTE_INPUT, (84, 336), "[10, 40, 30, 120]", 1.0),
    # relative 0-1000: [125, 125, 375, 375] * 168 / 1000 = [21, 21, 63, 63]: 39^2 / (1600 + 42^2 - 39^2)
    ("relative 1000", CoordinateFrame.RELATIVE_1000, (84, 84), "[125, 125, 375, 375]", 1521 / 1843),
    # [10, 10, 30, 30] read as relative is a tiny box in the top-left corner
    ("relative 1000, absolute numbers", CoordinateFrame.RELATIVE_1000, (84, 84), "[10, 10, 30, 30]", 0.0),
    (
        "relative 1000, beyond 1000",
        CoordinateFrame.RELATIVE_1000,
        (84, 84),
        "[0, 0, 2000, 2000]",
        1600 / 168**2,
    ),
    # a finite number that overflows only after the conversion (x2 in pixels)
    ("overflow after conversion", CoordinateFrame.ABSOLUTE_INPUT, (84, 84), "[20, 20, 1.7e308, 60]", 0.0),
]


@pytest.mark.parametrize(
    ("frame", "input_size", "box_text", "expected_iou"),
    [row[1:] for row in FRAME_TABLE],
    ids=[row[0] for row in FRAME_TABLE],
)
def test_reward_converts_the_model_frame_to_original_pixels(frame, input_size, box_text, expected_iou):
    text = f"{T}<answer>{box_text}</answer>"
    parts = grounding.reward(_completion(text, frame, input_size, (168, 168)), _sample())
    # the format part depends on the text only, not on the frame
    _assert_parts(parts, _expected(expected_iou, True))


def test_reward_on_a_non_square_original_clips_to_that_image():
    # original 200x100, model saw 100x50: [0, 0, 150, 75] -> [0, 0, 300, 150] -> clipped [0, 0, 200, 100]
    sample = _sample(box=(20, 10, 60, 50), width=200, height=100)
    completion = _completion(
        f"{T}<answer>[0, 0, 150, 75]</answer>", input_size=(100, 50), original_size=(200, 100)
    )
    assert grounding.reward(completion, sample)["iou"] == pytest.approx(1600 / 20000, abs=EXACT, rel=0)


def test_reward_never_raises_on_garbage():
    garbage = ["<answer>", "</answer><answer>", "<think><answer>[1,2,3,4]</answer></think>", "[" * 10000]
    garbage += ["<answer>" + "(" * 5000 + "</answer>", "<answer>\x00\uffff</answer>", "<answer>[1,2,3,4]" * 3]
    for text in garbage:
        parts = grounding.reward(_completion(text), _sample())
        assert set(parts) == {"reward", "iou", "format", "acc_iou50"}
        assert all(0.0 <= v <= 1.5 for v in parts.values())


def test_task_is_registered():
    task = get_task("grounding")
    assert task is grounding.TASK
    assert task.load is grounding.load and task.reward is grounding.reward
    assert task.metrics == ("iou", "format", "acc_iou50", "right_thought")
    assert task.reward_weights == {"iou": 1.0, "format": 0.5}
    assert "<think></think>" in task.instruction and "<answer></answer>" in task.instruction


# ---------------------------------------------------------------------------------------------- loaders


def _png_bytes(size):
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 200, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_load_lmms_refcoco_parquet(tmp_path):
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "question_id": pa.array(["q1", "q2"]),
            "image": pa.array(
                [
                    {"bytes": _png_bytes((40, 30)), "path": None},
                    {"bytes": _png_bytes((64, 48)), "path": None},
                ],
                type=image_type,
            ),
            "question": ["Please carefully observe the area circled in the image and come up with a caption."]
            * 2,
            "answer": pa.array([["man on the left", "left guy"], ["white dog."]], type=pa.list_(pa.string())),
            "segmentation": pa.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], type=pa.list_(pa.float32())),
            "bbox": pa.array([[5.0, 6.0, 10.0, 12.0], [0.5, 1.5, 20.25, 30.0]], type=pa.list_(pa.float64())),
            "iscrowd": [0, 0],
            "file_name": ["COCO_train2014_000000000001.jpg", "COCO_train2014_000000000002.jpg"],
        }
    )
    path = tmp_path / "refcoco_val.parquet"
    pq.write_table(table, path)

    samples = grounding.load("val", str(path))  # split is ignored for a file

    assert [s.id for s in samples] == ["q1", "q2"]
    assert samples[0].question == "Locate: man on the left."  # the first expression of `answer`
    assert samples[1].question == "Locate: white dog."
    assert samples[0].answer == [5.0, 6.0, 15.0, 18.0]  # [x, y, w, h] -> [x1, y1, x2, y2]
    assert samples[1].answer == [0.5, 1.5, 20.75, 31.5]
    assert isinstance(samples[0].images[0], Image.Image) and samples[0].images[0].size == (40, 30)
    assert samples[1].meta["width"] == 64 and samples[1].meta["height"] == 48
    assert samples[0].meta["file_name"] == "COCO_train2014_000000000001.jpg"
    assert all(s.task == "grounding" for s in samples)


def test_load_parquet_without_required_columns_names_them(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"question_id": ["q1"], "text": ["hi"]}), path)
    with pytest.raises(ValueError, match="image, answer, bbox"):
        grounding.load("train", str(path))


def test_load_vlm_r1_json(tmp_path):
    (tmp_path / "train2014").mkdir()
    Image.new("RGB", (64, 48)).save(tmp_path / "train2014" / "a.jpg")
    rows = [
        {
            "image": "train2014/a.jpg",
            "problem": "the woman in red",
            "solution": [1, 2, 30, 40],
            "normalized_solution": [15, 41, 468, 833],
            "height": 48,
            "width": 64,
        },
        {
            "image": "train2014/a.jpg",
            "problem": "<image>left dog",
            "solution": [0, 0, 10.5, 10],
            "height": 48,
            "width": 64,
        },
    ]
    path = tmp_path / "refcoco_train.json"
    path.write_text(json.dumps(rows))

    samples = grounding.load(source=str(path))

    assert [s.id for s in samples] == ["refcoco_train_0", "refcoco_train_1"]
    assert samples[0].question == "Locate: the woman in red."
    assert samples[1].question == "Locate: left dog."
    assert samples[0].answer == [1.0, 2.0, 30.0, 40.0] and samples[1].answer == [0.0, 0.0, 10.5, 10.0]
    assert samples[0].images == (str((tmp_path / "train2014" / "a.jpg").resolve()),)
    assert samples[0].meta == {"width": 64, "height": 48}

    # image paths relative to an explicit image_root instead of the JSON's folder
    annotations = tmp_path / "annotations"
    annotations.mkdir()
    (annotations / "rec.json").write_text(json.dumps(rows[:1]))
    rooted = grounding.load(source=str(annotations / "rec.json"), image_root=str(tmp_path))
    assert rooted[0].images == samples[0].images


def test_load_project_jsonl(tmp_path):
    (tmp_path / "images").mkdir()
    Image.new("RGB", (50, 40)).save(tmp_path / "images" / "x.png")
    rows = [
        {"id": 7, "image": "images/x.png", "expression": "the blue square", "box": [1, 2, 11, 12], "width": 50,
         "height": 40, "reference_thought": "the small blue square is at the top left"},
        {"id": "b", "image": "images/x.png", "expression": "the red circle.", "box": [3, 4, 5, 6]},
    ]  # fmt: skip
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")

    samples = grounding.load(source=str(path))

    assert [s.id for s in samples] == ["7", "b"]
    assert samples[0].question == "Locate: the blue square."
    assert samples[1].question == "Locate: the red circle."
    assert samples[0].answer == [1.0, 2.0, 11.0, 12.0]
    assert samples[0].meta == {"width": 50, "height": 40, "reference_thought": rows[0]["reference_thought"]}
    assert samples[1].meta == {"width": 50, "height": 40}  # read from the image header when absent
    assert samples[0].images == (str((tmp_path / "images" / "x.png").resolve()),)


def test_load_rejects_bad_sources(tmp_path):
    with pytest.raises(ValueError, match=r"'validation'.*train, test"):
        grounding.load("validation")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.jsonl, \.parquet, \.json"):
        grounding.load(source=str(tmp_path / "boxes.csv"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        grounding.load(source=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "image": "x.png", "box": [1, 2, 3, 4]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing expression"):
        grounding.load(source=str(bad))
    three = tmp_path / "three.jsonl"
    three.write_text(
        json.dumps({"id": 1, "image": "x.png", "expression": "e", "box": [1, 2, 3], "width": 9, "height": 9})
    )
    with pytest.raises(ValueError, match="4 numbers"):
        grounding.load(source=str(three))


# ---------------------------------------------------------------------------------------------- embedded data


@pytest.fixture(scope="module")
def embedded():
    return {split: grounding.load(split) for split in ("train", "test")}


@pytest.fixture(scope="module")
def embedded_rows():
    data_dir = REPO / "data" / "grounding"
    return {
        split: [json.loads(line) for line in (data_dir / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "test")
    }


def test_embedded_splits_load_with_boxes_inside_their_images(embedded):
    assert len(embedded["train"]) == 2000 and len(embedded["test"]) == 200
    for samples in embedded.values():
        assert len({s.id for s in samples}) == len(samples)
        for s in samples:
            x1, y1, x2, y2 = s.answer
            assert 0 <= x1 < x2 <= s.meta["width"] and 0 <= y1 < y2 <= s.meta["height"]
            assert s.question.startswith("Locate: the ") and s.question.endswith(".")
            assert s.meta["reference_thought"]
            assert Path(s.images[0]).is_file()
    for s in embedded["test"]:
        with Image.open(s.images[0]) as image:
            assert image.mode == "RGB" and image.size == (s.meta["width"], s.meta["height"]) == (168, 168)


def test_embedded_data_is_small():
    total = sum(p.stat().st_size for p in (REPO / "data" / "grounding").rglob("*") if p.is_file())
    assert total < 5_000_000


def test_embedded_boxes_are_tight_around_the_rendered_objects(embedded_rows):
    for row in embedded_rows["test"][:25]:
        with Image.open(REPO / "data" / "grounding" / row["image"]) as image:
            pixels = image.convert("RGB")
        for obj in row["objects"]:
            x1, y1, x2, y2 = obj["box"]
            # the box grown by 2 px holds only this object (objects are >= 4 px apart); object colours are
            # saturated (a channel of 60 or less), the background ramp never goes below ~110
            window = pixels.crop((x1 - 2, y1 - 2, x2 + 2, y2 + 2))
            foreground = Image.new("L", window.size)
            foreground.putdata([255 if min(p) < 90 else 0 for p in window.get_flattened_data()])
            assert foreground.getbbox() == (2, 2, x2 - x1 + 2, y2 - y1 + 2), (row["id"], obj)
        assert row["box"] == row["objects"][row["target"]]["box"]


# An independent reader of the generator's expression grammar, used to check that each expression
# picks out exactly its target under both readings of a relation.
_PHRASE = r"the (?:(small|large) )?(?:(red|green|blue|yellow) )?(circle|square|triangle)"
_EXPRESSION = re.compile(rf"{_PHRASE}(?: (left of|right of|above|below) {_PHRASE})?")


def _fits(obj, size, colour, shape):
    return obj["shape"] == shape and size in (None, obj["size"]) and colour in (None, obj["colour"])


def _holds(relation, a, b, strict):
    if strict:
        return {
            "left of": a[2] <= b[0],
            "right of": a[0] >= b[2],
            "above": a[3] <= b[1],
            "below": a[1] >= b[3],
        }[relation]
    ca, cb = ((a[0] + a[2]) / 2, (a[1] + a[3]) / 2), ((b[0] + b[2]) / 2, (b[1] + b[3]) / 2)
    return {
        "left of": ca[0] < cb[0],
        "right of": ca[0] > cb[0],
        "above": ca[1] < cb[1],
        "below": ca[1] > cb[1],
    }[relation]


def _referents(expression, objects, strict):
    match = _EXPRESSION.fullmatch(expression)
    assert match, expression
    size, colour, shape, relation, *landmark = match.groups()
    candidates = [i for i, o in enumerate(objects) if _fits(o, size, colour, shape)]
    if relation is None:
        return candidates
    landmarks = [i for i, o in enumerate(objects) if _fits(o, *landmark)]
    assert len(landmarks) == 1, f"ambiguous landmark in {expression!r}"
    box_of_landmark = objects[landmarks[0]]["box"]
    return [i for i in candidates if _holds(relation, objects[i]["box"], box_of_landmark, strict)]


@pytest.mark.parametrize("split", ["test", "train"])
def test_every_embedded_expression_picks_out_exactly_its_target(embedded_rows, split):
    for row in embedded_rows[split]:
        for strict in (True, False):
            assert _referents(row["expression"], row["objects"], strict) == [row["target"]], (
                row["id"],
                strict,
            )


@pytest.mark.parametrize("split", ["test", "train"])
def test_every_embedded_expression_uses_no_more_attributes_than_needed(embedded_rows, split):
    for row in embedded_rows[split]:
        match = _EXPRESSION.fullmatch(row["expression"])
        size, colour, shape, relation = match.groups()[:4]
        target = row["objects"][row["target"]]
        used = {name for name, value in (("size", size), ("colour", colour)) if value}
        for fewer in ([], ["colour"], ["size"], ["size", "colour"]):
            if relation is None and not set(fewer) < used:
                continue  # only strictly shorter attribute-only phrases must fail
            phrase = " ".join(
                ["the"] + [target[name] for name in ("size", "colour") if name in fewer] + [shape]
            )
            assert len(_referents(phrase, row["objects"], strict=True)) > 1, (row["id"], phrase)


def test_embedded_expressions_need_more_than_one_attribute_often(embedded_rows):
    expressions = [row["expression"] for row in embedded_rows["train"]]
    shape_only = sum(bool(re.fullmatch(r"the (circle|square|triangle)", e)) for e in expressions)
    relational = sum(any(r in e for r in ("left of", "right of", "above", "below")) for e in expressions)
    # distractors share attributes by design: most targets need a colour, a size or a relation
    assert shape_only < 0.4 * len(expressions)
    assert relational > 0.1 * len(expressions)
    for relation in ("left of", "right of", "above", "below"):
        assert any(relation in e for e in expressions)


def test_reference_thought_names_the_target_and_its_region(embedded_rows):
    for row in embedded_rows["test"]:
        target = row["objects"][row["target"]]
        assert row["reference_thought"].startswith(
            f"the {target['size']} {target['colour']} {target['shape']} is "
        )
        assert re.search(
            r"(at the (top|middle|bottom) (left|centre|right)|in the centre)$", row["reference_thought"]
        )


def test_reference_answer_on_embedded_sample_gets_full_reward(embedded):
    sample = embedded["test"][0]
    box = ",".join(str(int(v)) for v in sample.answer)
    text = f"<think>{sample.meta['reference_thought']}</think><answer>[{box}]</answer>"
    completion = _completion(text, original_size=(168, 168))
    _assert_parts(grounding.reward(completion, sample), {**_expected(1.0, True), "right_thought": 1.0})


# ---------------------------------------------------------------------------------------------- generator


def _pixels(path):
    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


def test_generator_is_deterministic(tmp_path):
    first = make_grounding.generate(tmp_path / "a", 6, seed=11, split="train")
    second = make_grounding.generate(tmp_path / "b", 6, seed=11, split="train")
    other = make_grounding.generate(tmp_path / "c", 6, seed=12, split="train")
    assert first == second
    assert first != other
    for row in first:
        assert _pixels(tmp_path / "a" / row["image"]) == _pixels(tmp_path / "b" / row["image"])


def test_embedded_test_split_matches_the_generator(tmp_path, embedded_rows):
    n, seed = make_grounding.SPLIT_SIZES_AND_SEEDS["test"]
    rows = make_grounding.generate(tmp_path, 4, seed=seed, split="test")  # a prefix of the split
    assert rows == embedded_rows["test"][:4]
    for row in rows:
        assert _pixels(tmp_path / row["image"]) == _pixels(REPO / "data" / "grounding" / row["image"])
    assert len(embedded_rows["test"]) == n


def test_write_split_writes_jsonl_the_loader_reads(tmp_path):
    make_grounding.write_split(tmp_path, "test", 3, seed=5)
    samples = grounding.load(source=str(tmp_path / "test.jsonl"))
    assert [s.id for s in samples] == ["test_00000", "test_00001", "test_00002"]
    assert all(Path(s.images[0]).is_file() for s in samples)


@pytest.mark.parametrize(
    "thought, expected",
    [
        ("the large red square is at the middle right", 1.0),
        ("  the large red  square is at the\nmiddle right ", 1.0),  # spacing aside
        ("the large red square is at the middle left", 0.0),  # the wrong place
        ("the large blue square is at the middle right", 0.0),  # the distractor
        ("the large red square is at the middle right and more", 0.0),
        ("", 0.0),
    ],
)
def test_right_thought_compares_the_think_part_with_the_reference_word_for_word(thought, expected):
    sample = _sample()
    sample.meta["reference_thought"] = "the large red square is at the middle right"
    parts = grounding.reward(_completion(f"<think>{thought}</think><answer>[20,20,60,60]</answer>"), sample)
    assert parts["right_thought"] == expected
    assert parts["reward"] == 1.5  # logged, not rewarded: a perfect box pays the same with any thought


def test_right_thought_needs_one_think_part_and_a_reference():
    sample = _sample()
    sample.meta["reference_thought"] = "the red square"
    twice = "<think>the red square</think><think>the red square</think><answer>[20,20,60,60]</answer>"
    assert grounding.reward(_completion(twice), sample)["right_thought"] == 0.0
    assert "right_thought" not in grounding.reward(_completion("<think>the red square</think><answer>[1,1,2,2]</answer>"), _sample())
