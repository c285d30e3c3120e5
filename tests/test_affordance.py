"""The affordance task: reward tables (malformed output included), coordinate frames, targets, loaders, embedded data."""

import importlib.util
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks import affordance
from tasks.affordance import AffordanceTarget
from vlm_grpo_ma.task_api.coords import CoordinateFrame, from_original_pixels
from vlm_grpo_ma.task_api.registry import Completion, Sample, get_task

EXACT = 1e-12
REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "affordance"
DATA_DIR = REPO / "data" / "affordance"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_affordance", REPO / "data" / "make_affordance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


make_affordance = _load_generator()


def _region_mask(width=100, height=80, box=(20, 10, 40, 30)):
    """A [height, width] boolean mask whose target pixels are x in [box[0], box[2]), y in [box[1], box[3])."""
    mask = np.zeros((height, width), dtype=bool)
    mask[box[1] : box[3], box[0] : box[2]] = True
    return mask


def _sample(answer=None, width=100, height=80) -> Sample:
    return Sample(
        task="affordance",
        id="s0",
        question="Where would you grasp the mug?",
        images=("unused.png",),
        answer=AffordanceTarget(mask=_region_mask(width, height)) if answer is None else answer,
        meta={"width": width, "height": height},
    )


def _completion(text, frame=CoordinateFrame.ABSOLUTE_INPUT, input_size=(100, 80), original_size=(100, 80)):
    # Split where the policy would: the thought runs up to and including "</think>".
    cut = text.index("</think>") + len("</think>") if "</think>" in text else len(text)
    return Completion(
        thought=text[:cut],
        answer=text[cut:],
        frame=frame,
        input_sizes=(input_size,),
        original_sizes=(original_size,),
    )


def _expected(inside, format_ok, first_inside):
    return {
        "inside": inside,
        "format": float(format_ok),
        "point_acc": float(first_inside),
        "reward": 1.0 * inside + 0.5 * float(format_ok),
    }


def _assert_parts(parts, expected):
    assert set(parts) == set(expected)
    for name, value in expected.items():
        assert parts[name] == pytest.approx(value, abs=EXACT, rel=0), name


T = "<think>the handle is on the right of the mug</think>"


def _answer(inner):
    return f"{T}<answer>{inner}</answer>"


def _points(points):
    return "[" + ", ".join(f"({x}, {y})" for x, y in points) + "]"


ZERO = _expected(0.0, False, False)

# Target: the mask pixels x in [20, 40), y in [10, 30) (400 pixels) of a 100x80 image; model frame = pixels.
REWARD_TABLE = [
    ("one point inside", _answer("[(25, 15)]"), _expected(1.0, True, True)),
    ("a point without a list", _answer("(25, 15)"), _expected(1.0, True, True)),
    ("nested lists", _answer("[[25, 15], [30, 20]]"), _expected(1.0, True, True)),
    (
        "json point_2d",
        _answer('[{"point_2d": [25, 15]}, {"point_2d": [60, 60]}]'),
        _expected(0.5, True, True),
    ),
    ("bare numbers", _answer("25, 15"), _expected(1.0, True, True)),
    ("whitespace around tags", "\n " + T + "\n<answer> [(25,15)] </answer>\n", _expected(1.0, True, True)),
    ("half inside", _answer("[(25, 15), (60, 60)]"), _expected(0.5, True, True)),
    ("first point misses", _answer("[(60, 60), (25, 15)]"), _expected(0.5, True, False)),
    ("two of three", _answer("[(25, 15), (39, 29), (0, 0)]"), _expected(2 / 3, True, True)),
    ("region corners are inside", _answer("[(20.0, 10.0), (39.99, 29.99)]"), _expected(1.0, True, True)),
    ("right and bottom edges are outside", _answer("[(40, 15), (25, 30)]"), _expected(0.0, True, False)),
    ("just left of the region", _answer("[(19.999, 15)]"), _expected(0.0, True, False)),
    ("a repeated good point", _answer("[(25, 15), (25, 15), (25, 15)]"), _expected(1.0, True, True)),
    ("MAX_POINTS points", _answer(_points([(25, 15)] * 10)), _expected(1.0, True, True)),
    # spraying: one point over the cap and nothing is graded, even when every point is inside
    ("one point too many", _answer(_points([(25, 15)] * 11)), ZERO),
    ("1000 points", _answer(_points([(i % 100, i % 80) for i in range(1000)])), ZERO),
    (
        "points outside the image",
        _answer("[(-5, 15), (100, 15), (25, 80), (25, 15)]"),
        _expected(0.25, True, False),
    ),
    ("negative numbers", _answer("[(-25, -15)]"), _expected(0.0, True, False)),
    ("huge numbers", _answer("[(1e300, 15)]"), _expected(0.0, True, False)),
    # one box instead of points: the fraction of its pixels (by centre) that are target pixels
    ("box equal to the region", _answer("[20, 10, 40, 30]"), _expected(1.0, True, True)),
    ("box inside the region", _answer("[22, 12, 30, 20]"), _expected(1.0, True, True)),
    ("box with swapped corners", _answer("[40, 30, 20, 10]"), _expected(1.0, True, True)),
    # 40x20 pixels, 20x20 of them in the region; the centre (40, 20) is on the excluded right edge
    ("box half on the region", _answer("[20, 10, 60, 30]"), _expected(0.5, True, False)),
    ("box a quarter on the region", _answer("[30, 20, 50, 40]"), _expected(0.25, True, False)),
    # 200x160 pixels counted, 400 of them in the region (the part outside the image counts as misses)
    ("box beyond the image", _answer("[0, 0, 200, 160]"), _expected(400 / 32000, True, False)),
    (
        "qwen2.5-vl json box",
        _answer('```json\n[{"bbox_2d": [20, 10, 40, 30], "label": "the handle"}]\n```'),
        _expected(1.0, True, True),
    ),
    # pixel centres: columns with 19.6 <= c + 0.5 < 20.6 -> c = 20; rows with 10 <= r + 0.5 < 11 -> r = 10
    ("one-pixel box by centres", _answer("[19.6, 10, 20.6, 11]"), _expected(1.0, True, True)),
    # a box that covers no pixel centre marks no place, even with its centre in the region
    ("zero-area box", _answer("[25, 12, 25, 20]"), _expected(0.0, True, False)),
    ("box between pixel centres", _answer("[25.6, 12, 26.4, 20]"), _expected(0.0, True, False)),
    # nothing to grade
    ("no tags", "[(25, 15)]", ZERO),
    ("only think", "<think>[(25, 15)]</think>", ZERO),
    ("empty answer", _answer(""), ZERO),
    ("empty list", _answer("[]"), ZERO),
    ("truncated answer", T + "<answer>[(25, 15), (3", ZERO),
    ("two answer tags", _answer("[(25, 15)]") + "<answer>[(25, 15)]</answer>", ZERO),
    ("nan", _answer("[(nan, 15)]"), ZERO),
    ("inf", _answer("[(25, inf)]"), ZERO),
    ("overflowing literal", _answer("[(1e999, 15)]"), ZERO),
    ("nan in a box", _answer("[20, 10, nan, 30]"), ZERO),
    ("text instead of numbers", _answer("[(x, y)]"), ZERO),
    ("words only", _answer("the handle of the mug"), ZERO),
    ("spelled numbers", _answer("[(twenty-five, 15)]"), ZERO),
    ("three numbers", _answer("[(25, 15, 3)]"), ZERO),
    ("points and a box mixed", _answer("[(25, 15), [20, 10, 40, 30]]"), ZERO),
    ("nested garbage json", _answer("[[25, 15], [3]]"), ZERO),
    ("unbalanced brackets", _answer("[[[(25, 15"), ZERO),
    ("json null", _answer("null"), ZERO),
    ("json booleans", _answer("[true, false]"), ZERO),
    ("empty", "", ZERO),
    # points in a single answer tag are graded, but the format part is lost
    ("answer without think", "<answer>[(25, 15)]</answer>", _expected(1.0, False, True)),
    ("extra text after", _answer("[(25, 15)]") + " Done.", _expected(1.0, False, True)),
]


@pytest.mark.parametrize(
    ("text", "expected"), [row[1:] for row in REWARD_TABLE], ids=[r[0] for r in REWARD_TABLE]
)
def test_reward_table(text, expected):
    _assert_parts(affordance.reward(_completion(text), _sample()), expected)


# Without a mask the box is the target: (20.6, 10, 40, 30), half-open like pixels.
BOX_TARGET_TABLE = [
    ("left edge is inside", "[(20.6, 10)]", _expected(1.0, True, True)),
    ("just left of the box", "[(20.5, 15)]", _expected(0.0, True, False)),
    ("near the far corner", "[(39.999, 29.999)]", _expected(1.0, True, True)),
    ("right edge is outside", "[(40, 15)]", _expected(0.0, True, False)),
    ("bottom edge is outside", "[(25, 30)]", _expected(0.0, True, False)),
    # the target box covers the pixel centres of columns 21..39 (c + 0.5 >= 20.6) and rows 10..29: 19 x 20
    ("box answer over the box", "[20, 10, 40, 30]", _expected(380 / 400, True, True)),
]


@pytest.mark.parametrize(
    ("inner", "expected"), [row[1:] for row in BOX_TARGET_TABLE], ids=[r[0] for r in BOX_TARGET_TABLE]
)
def test_reward_with_a_box_target(inner, expected):
    sample = _sample(AffordanceTarget(box=[20.6, 10, 40, 30]))
    _assert_parts(affordance.reward(_completion(_answer(inner)), sample), expected)


def test_the_mask_wins_over_the_box():
    sample = _sample(AffordanceTarget(mask=_region_mask(), box=(60, 50, 90, 70)))
    _assert_parts(affordance.reward(_completion(_answer("[(70, 60)]")), sample), _expected(0.0, True, False))
    _assert_parts(affordance.reward(_completion(_answer("[(25, 15)]")), sample), _expected(1.0, True, True))


# The same target (x in [20, 40), y in [10, 30) of a 100x80 original) written in different model frames.
FRAME_TABLE = [
    # Qwen2.5-VL saw the image resized to 50x40: its pixels are half the original's.
    ("absolute 50x40, converted", CoordinateFrame.ABSOLUTE_INPUT, (50, 40), "[(12.5, 7.5)]", 1.0, True),
    # the original's numbers read in the 50x40 frame become (50, 30): outside
    ("absolute 50x40, unconverted", CoordinateFrame.ABSOLUTE_INPUT, (50, 40), "[(25, 15)]", 0.0, False),
    ("absolute 200x160", CoordinateFrame.ABSOLUTE_INPUT, (200, 160), "[(50, 30), (79, 59)]", 1.0, True),
    ("absolute, non-square input", CoordinateFrame.ABSOLUTE_INPUT, (50, 160), "[(12.5, 30)]", 1.0, True),
    ("absolute, box", CoordinateFrame.ABSOLUTE_INPUT, (50, 40), "[10, 5, 30, 15]", 0.5, False),
    # relative 0-1000: x * 100 / 1000, y * 80 / 1000
    ("relative 1000", CoordinateFrame.RELATIVE_1000, (50, 40), "[(250, 187.5)]", 1.0, True),
    ("relative 1000, far corner", CoordinateFrame.RELATIVE_1000, (50, 40), "[(390, 370)]", 1.0, True),
    ("relative 1000, on the edges", CoordinateFrame.RELATIVE_1000, (50, 40), "[(400, 375)]", 0.0, False),
    ("relative 1000, pixel numbers", CoordinateFrame.RELATIVE_1000, (50, 40), "[(25, 15)]", 0.0, False),
    ("relative 1000, box", CoordinateFrame.RELATIVE_1000, (50, 40), "[200, 125, 400, 375]", 1.0, True),
    ("relative 1000, beyond 1000", CoordinateFrame.RELATIVE_1000, (50, 40), "[(1250, 187.5)]", 0.0, False),
    # finite numbers that overflow only after the conversion (x 2 in pixels)
    (
        "point overflow after conversion",
        CoordinateFrame.ABSOLUTE_INPUT,
        (50, 40),
        "[(1.7e308, 15)]",
        0.0,
        False,
    ),
    (
        "box overflow after conversion",
        CoordinateFrame.ABSOLUTE_INPUT,
        (50, 40),
        "[0, 0, 1.7e308, 30]",
        0.0,
        False,
    ),
]


@pytest.mark.parametrize(
    ("frame", "input_size", "inner", "inside", "first_inside"),
    [row[1:] for row in FRAME_TABLE],
    ids=[row[0] for row in FRAME_TABLE],
)
def test_reward_converts_the_model_frame_to_original_pixels(frame, input_size, inner, inside, first_inside):
    parts = affordance.reward(_completion(_answer(inner), frame, input_size, (100, 80)), _sample())
    # the format part depends on the text only, not on the frame
    _assert_parts(parts, _expected(inside, True, first_inside))


def test_reward_on_a_non_square_original():
    # original 60x200 with target x in [50, 60), y in [150, 200); the model saw 30x100
    sample = _sample(AffordanceTarget(mask=_region_mask(60, 200, (50, 150, 60, 200))), width=60, height=200)
    completion = _completion(
        _answer("[(29.9, 99.9), (29.9, 74.9), (30, 99)]"), input_size=(30, 100), original_size=(60, 200)
    )
    # (59.8, 199.8) in; (59.8, 149.8) just above; (60, 198) on the right border of the image
    _assert_parts(affordance.reward(completion, sample), _expected(1 / 3, True, True))


def test_reward_never_raises_on_garbage():
    garbage = ["<answer>", "</answer><answer>", "<think><answer>[(1,2)]</answer></think>", "[" * 10000]
    garbage += ["<answer>" + "(" * 5000 + "</answer>", "<answer>\x00\uffff</answer>", "<answer>[(1,2)]" * 3]
    garbage += [
        _answer("[" * 3000 + "1, 2" + "]" * 3000),
        _answer("(1, 2) " * 5000),
        _answer("1e" + "9" * 400),
    ]
    for text in garbage:
        parts = affordance.reward(_completion(text), _sample())
        assert set(parts) == {"reward", "inside", "format", "point_acc"}
        assert all(0.0 <= v <= 1.5 for v in parts.values())


def test_unreadable_target_scores_zero_and_is_logged_once(tmp_path, caplog):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png at all")
    truncated = tmp_path / "truncated.png"
    Image.fromarray(np.arange(64 * 64, dtype=np.uint32).reshape(64, 64).astype(np.uint8)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:60])
    good = _answer("[(25, 15)]")
    with caplog.at_level(logging.WARNING, logger="tasks.affordance"):
        for path in (tmp_path / "deleted.png", broken, truncated):
            sample = _sample(AffordanceTarget(mask=str(path)))
            for _ in range(3):
                _assert_parts(affordance.reward(_completion(good), sample), ZERO)
    for path in ("deleted.png", "broken.png", "truncated.png"):
        assert sum(path in record.getMessage() for record in caplog.records) == 1, path


def test_reward_reads_a_mask_file_once(tmp_path, monkeypatch):
    path = tmp_path / "mask.png"
    Image.fromarray(_region_mask()).save(path)
    sample = _sample(AffordanceTarget(mask=str(path)))
    opened = []
    real_open = Image.open
    monkeypatch.setattr(affordance.Image, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    for inner, inside in (("[(25, 15)]", 1.0), ("[(60, 60)]", 0.0), ("[(39, 29)]", 1.0)):
        assert affordance.reward(_completion(_answer(inner)), sample)["inside"] == inside
    assert opened == [str(path)]


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"mask": _region_mask(), "box": None}, _expected(1.0, True, True)),
        ({"box": [20, 10, 40, 30]}, _expected(1.0, True, True)),
        ({"box": [20, 10, 40]}, ZERO),
        ({}, ZERO),
        (None, ZERO),
        ([20, 10, 40, 30], ZERO),
    ],
    ids=["dict mask", "dict box", "dict bad box", "empty dict", "none", "a bare list"],
)
def test_reward_target_forms(answer, expected):
    sample = Sample(
        task="affordance", id="s", question="q", images=(), answer=answer, meta={"width": 100, "height": 80}
    )
    _assert_parts(affordance.reward(_completion(_answer("[(25, 15)]")), sample), expected)


def test_task_is_registered():
    task = get_task("affordance")
    assert task is affordance.TASK
    assert task.load is affordance.load and task.reward is affordance.reward
    assert task.metrics == ("inside", "format", "point_acc")
    assert task.reward_weights == {"inside": 1.0, "format": 0.5}
    assert "<think></think>" in task.instruction and "<answer></answer>" in task.instruction
    assert f"up to {affordance.MAX_POINTS} points" in task.instruction


# ---------------------------------------------------------------------------------------------- targets


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([[0, 1], [1, 0]], [[False, True], [True, False]]),  # a 0/1 label image
        ([[0, 255], [3, 200]], [[False, True], [False, True]]),  # JPEG ringing (3) is not target
        ([[0, 127], [128, 255]], [[False, False], [True, True]]),  # over half of 255
        ([[0.0, 0.4], [0.6, 1.0]], [[False, False], [True, True]]),
        ([[0, 0], [0, 0]], [[False, False], [False, False]]),
        ([[True, False], [False, False]], [[True, False], [False, False]]),
    ],
)
def test_binarise_mask(values, expected):
    result = affordance.binarise_mask(np.array(values))
    assert result.dtype == np.bool_ and result.tolist() == expected


def test_target_validation():
    with pytest.raises(ValueError, match="needs a mask, a box, or both"):
        AffordanceTarget()
    with pytest.raises(ValueError, match=r"4 finite numbers.*\[1, 2, 3\]"):
        AffordanceTarget(box=[1, 2, 3])
    with pytest.raises(ValueError, match="4 finite numbers"):
        AffordanceTarget(box=[1, 2, float("nan"), 4])
    with pytest.raises(ValueError, match="4 finite numbers"):
        AffordanceTarget(box=[1, 2, True, 4])
    with pytest.raises(ValueError, match="positive area"):
        AffordanceTarget(box=[5, 2, 5, 9])
    with pytest.raises(ValueError, match=r"2-D \[H, W\], got shape \(4, 4, 3\)"):
        AffordanceTarget(mask=np.zeros((4, 4, 3)))
    with pytest.raises(ValueError, match="a path or a 2-D array, got int"):
        AffordanceTarget(mask=7)
    target = AffordanceTarget(mask=np.array([[0, 255]], dtype=np.uint8), box=(9, 8, np.int64(1), 2))
    assert target.box == (1.0, 2.0, 9.0, 8.0)  # corners sorted
    assert target.mask.tolist() == [[False, True]] and not target.mask.flags.writeable
    assert AffordanceTarget(mask=Path("a/b.png")).mask == "a/b.png"


# ---------------------------------------------------------------------------------------------- loaders


def _reward_of(sample, points):
    size = (sample.meta["width"], sample.meta["height"])
    completion = _completion(_answer(_points(points)), input_size=size, original_size=size)
    return affordance.reward(completion, sample)


def test_load_project_jsonl():
    root = FIXTURES / "project"
    samples = affordance.load(source=str(root / "affordance.jsonl"))

    assert [s.id for s in samples] == ["grasp_1", "2", "place_3"]
    assert [s.question for s in samples] == [
        "Where would you grasp the mug?",
        "Where would you press the button?",
        "Where would you place the cup?",
    ]
    assert all(s.task == "affordance" for s in samples)
    assert all(s.images == (str((root / "images" / "scene.png").resolve()),) for s in samples)
    grasp, press, place = samples
    assert grasp.answer.mask == str((root / "masks" / "grasp.png").resolve()) and grasp.answer.box is None
    assert grasp.meta == {
        "width": 24,
        "height": 16,
        "reference_point": [5.0, 3.0],
        "kind": "grasp",
        "reference_thought": "the handle is at the top left",
    }
    assert press.answer.mask is None and press.answer.box == (1.0, 9.0, 5.0, 15.0)
    assert press.meta == {"width": 24, "height": 16}  # read from the image header when absent
    assert place.answer.mask == str((root / "masks" / "label.png").resolve())
    assert place.answer.box == (10.0, 8.0, 20.0, 14.0)

    # the targets as drawn: grasp x 4..7, y 2..5 (1-bit); press the box; place x 10..19, y 8..13 (0/1 labels)
    assert _reward_of(grasp, [(4, 2), (7.9, 5.9)])["inside"] == 1.0
    assert _reward_of(grasp, [(8, 3), (5, 6), (3.9, 3)])["inside"] == 0.0
    assert _reward_of(press, [(1, 9), (4.9, 14.9)])["inside"] == 1.0
    assert _reward_of(press, [(5, 9), (1, 15)])["inside"] == 0.0
    assert _reward_of(place, [(10, 8), (19, 13)])["inside"] == 1.0
    assert _reward_of(place, [(9, 8), (20, 13), (10, 14)])["inside"] == 0.0


def test_load_project_jsonl_with_image_root(tmp_path):
    rows = [
        {
            "id": "a",
            "image": "scene.png",
            "mask": "../masks/grasp.png",
            "question": "Grasp?",
            "width": 24,
            "height": 16,
        }
    ]
    (tmp_path / "rooted.jsonl").write_text(json.dumps(rows[0]) + "\n")
    [sample] = affordance.load(
        source=str(tmp_path / "rooted.jsonl"), image_root=str(FIXTURES / "project" / "images")
    )
    assert sample.images == (str((FIXTURES / "project" / "images" / "scene.png").resolve()),)
    assert sample.answer.mask == str((FIXTURES / "project" / "masks" / "grasp.png").resolve())


def test_load_where2place():
    root = FIXTURES / "where2place"
    samples = affordance.load(source=str(root))  # the folder
    assert [s.id for s in samples] == ["where2place_0", "where2place_1"]
    # the benchmark's own format request (0-1 coordinates) is cut: INSTRUCTION and the model's frame rule
    assert [s.question for s in samples] == [
        "There is a mug on the desk. Pinpoint several points within the vacant space to the right of the mug.",
        "Find a few spots within the free area below the plate.",
    ]
    assert samples[0].images == (str((root / "images" / "00.jpg").resolve()),)
    assert (
        samples[1].answer.mask == str((root / "masks" / "01.jpg").resolve()) and samples[1].answer.box is None
    )
    assert [s.meta for s in samples] == [{"width": 32, "height": 20}, {"width": 20, "height": 32}]

    # JPEG masks ring with faint nonzero values next to the region; those pixels are not target
    with Image.open(root / "masks" / "00.jpg") as image:
        raw = np.asarray(image)
    assert (raw[~_region_mask(32, 20, (8, 4, 24, 12))] > 0).any()
    assert (
        affordance.read_mask(samples[0].answer.mask).tolist() == _region_mask(32, 20, (8, 4, 24, 12)).tolist()
    )
    assert _reward_of(samples[0], [(8, 4), (23.9, 11.9)])["inside"] == 1.0
    assert _reward_of(samples[0], [(7, 4), (24, 4), (8, 12)])["inside"] == 0.0
    assert _reward_of(samples[1], [(2, 16), (9, 29)])["inside"] == 1.0
    assert _reward_of(samples[1], [(1, 16), (2, 30)])["inside"] == 0.0

    # the JSONL file itself reads the same; image_root moves only the images
    from_file = affordance.load(source=str(root / "point_questions.jsonl"))
    assert [(s.id, s.question, s.images, s.answer.mask, s.meta) for s in from_file] == [
        (s.id, s.question, s.images, s.answer.mask, s.meta) for s in samples
    ]


def test_load_where2place_with_image_root(tmp_path):
    shutil.copy(FIXTURES / "where2place" / "point_questions.jsonl", tmp_path)
    shutil.copytree(FIXTURES / "where2place" / "masks", tmp_path / "masks")
    shutil.copytree(FIXTURES / "where2place" / "images", tmp_path / "photos")
    samples = affordance.load(source=str(tmp_path), image_root=str(tmp_path / "photos"))
    assert samples[1].images == (str((tmp_path / "photos" / "01.jpg").resolve()),)
    assert samples[1].answer.mask == str((tmp_path / "masks" / "01.jpg").resolve())


def test_load_roborefit():
    root = FIXTURES / "roborefit"
    split = root / "final_dataset" / "testA"
    samples = affordance.load("testA", str(root))  # the dataset folder and a split
    assert [s.id for s in samples] == ["roborefit_0", "roborefit_1"]
    assert [s.question for s in samples] == [
        "Point to the object meant by: the red cup on the left.",
        "Point to the object meant by: give me the banana.",
    ]
    # Windows separators, relative to the folder holding final_dataset
    assert samples[0].images == (str((split / "image" / "0000000.png").resolve()),)
    assert samples[1].answer.mask == str((split / "mask" / "0000001" / "0.png").resolve())
    assert samples[1].answer.box == (20.0, 2.0, 30.0, 10.0)
    assert samples[0].meta == {"width": 32, "height": 24, "class": "cup", "scene": "table"}
    assert _reward_of(samples[0], [(3, 5), (10.5, 14.5)])["inside"] == 1.0
    assert _reward_of(samples[0], [(11, 5), (3, 15)])["inside"] == 0.0
    assert _reward_of(samples[1], [(20, 2), (29, 9)])["inside"] == 1.0

    # the annotation file itself (split ignored) reads the same
    from_file = affordance.load("train", str(split / "roborefit_testA.json"))
    assert [(s.id, s.question, s.images, s.answer.mask, s.answer.box, s.meta) for s in from_file] == [
        (s.id, s.question, s.images, s.answer.mask, s.answer.box, s.meta) for s in samples
    ]


def test_load_roborefit_jsonl_rows_with_boxes_only(tmp_path):
    rows = [
        {"text": "the mug", "bbox": [3, 5, 11, 15], "rgb_path": "final_dataset/testA/image/0000000.png"},
        {"text": "the banana", "bbox": [29, 9, 20, 2], "rgb_path": "final_dataset/testA/image/0000001.png"},
    ]
    path = tmp_path / "robo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = affordance.load(source=str(path), image_root=str(FIXTURES / "roborefit"))
    assert [s.id for s in samples] == ["robo_0", "robo_1"]
    assert samples[0].answer.mask is None and samples[0].answer.box == (3.0, 5.0, 11.0, 15.0)
    assert samples[1].answer.box == (20.0, 2.0, 29.0, 9.0)
    assert samples[1].meta == {"width": 32, "height": 24}
    assert _reward_of(samples[1], [(20, 2), (28.9, 8.9), (29, 5)])["inside"] == pytest.approx(
        2 / 3, abs=EXACT
    )


def _write_project(tmp_path, row, size=(24, 16)):
    (tmp_path / "images").mkdir(exist_ok=True)
    Image.new("RGB", size).save(tmp_path / "images" / "x.png")
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"id": 1, "image": "images/x.png", "question": "Where?", **row}) + "\n")
    return str(path)


def test_load_rejects_bad_sources(tmp_path):
    with pytest.raises(ValueError, match=r"'validation'.*train, test"):
        affordance.load("validation")
    with pytest.raises(ValueError, match=r"'\.csv'.*a folder or a file ending in \.jsonl, \.json"):
        affordance.load(source=str(tmp_path / "points.csv"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        affordance.load(source=str(tmp_path / "missing.jsonl"))
    with pytest.raises(
        ValueError, match=r"neither point_questions\.jsonl \(Where2Place\) nor final_dataset/"
    ):
        affordance.load(source=str(tmp_path))
    with pytest.raises(ValueError, match=r"RoboRefIt split 'val'.*train, testA, testB"):
        affordance.load("val", str(FIXTURES / "roborefit"))
    with pytest.raises(FileNotFoundError, match=r"final_dataset/train/roborefit_train\.json"):
        affordance.load("train", str(FIXTURES / "roborefit"))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"name": "x", "points": []}) + "\n")
    with pytest.raises(ValueError, match=r"\['name', 'points'\].*project id, image, question \| Where2Place"):
        affordance.load(source=str(other))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl: no rows"):
        affordance.load(source=str(empty))
    bad_json = tmp_path / "bad_json.jsonl"
    bad_json.write_text(
        json.dumps({"id": 1, "image": "x", "question": "q", "box": [1, 2, 3, 4]}) + "\n{oops\n"
    )
    with pytest.raises(ValueError, match=r"bad_json.jsonl:2: not JSON"):
        affordance.load(source=str(bad_json))
    not_list = tmp_path / "robo.json"
    not_list.write_text(json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match="JSON list of rows, got dict"):
        affordance.load(source=str(not_list))


def test_load_rejects_bad_project_rows(tmp_path):
    with pytest.raises(ValueError, match=r"rows.jsonl:1: a row needs a mask, a box, or both"):
        affordance.load(source=_write_project(tmp_path, {}))
    with pytest.raises(ValueError, match=r"rows.jsonl:1: a target box needs 4 finite numbers"):
        affordance.load(source=_write_project(tmp_path, {"box": [1, 2, 3]}))
    missing_question = tmp_path / "q.jsonl"
    missing_question.write_text(json.dumps({"id": 1, "image": "x.png", "box": [1, 2, 3, 4]}) + "\n")
    # the row names the project's keys but misses one: no format matches
    with pytest.raises(ValueError, match="match no affordance format"):
        affordance.load(source=str(missing_question))


def test_load_names_a_missing_or_broken_mask(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"rows.jsonl:1: mask file not found: .*masks/nope.png"):
        affordance.load(source=_write_project(tmp_path, {"mask": "masks/nope.png"}))
    (tmp_path / "masks").mkdir()
    (tmp_path / "masks" / "junk.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ValueError, match=r"mask file .*masks/junk.png cannot be read as an image"):
        affordance.load(source=_write_project(tmp_path, {"mask": "masks/junk.png"}))
    Image.new("L", (30, 16)).save(tmp_path / "masks" / "wide.png")
    with pytest.raises(ValueError, match=r"mask .*masks/wide.png is 30x16 but its image is 24x16"):
        affordance.load(source=_write_project(tmp_path, {"mask": "masks/wide.png"}))
    (tmp_path / "images" / "x.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"image file not found: .*images/x.png"):
        affordance.load(source=str(tmp_path / "rows.jsonl"))


def test_load_where2place_names_a_missing_mask(tmp_path):
    shutil.copytree(FIXTURES / "where2place", tmp_path / "w2p")
    (tmp_path / "w2p" / "masks" / "01.jpg").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"point_questions.jsonl:2: mask file not found: .*masks/01.jpg"
    ):
        affordance.load(source=str(tmp_path / "w2p"))
    rows = [{"question_id": "first", "image": "00.jpg", "text": "Where?"}]
    (tmp_path / "w2p" / "point_questions.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="question_id must be a non-negative integer, got 'first'"):
        affordance.load(source=str(tmp_path / "w2p"))


def test_load_roborefit_names_missing_files(tmp_path):
    shutil.copytree(FIXTURES / "roborefit", tmp_path / "robo")
    annotation = tmp_path / "robo" / "final_dataset" / "testA" / "roborefit_testA.json"
    (tmp_path / "robo" / "final_dataset" / "testA" / "mask" / "0000001" / "0.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"row 1: mask_path file not found: .*0000001\\\\0.png"):
        affordance.load("testA", str(tmp_path / "robo"))
    rows = json.loads(annotation.read_text())
    rows[0]["rgb_path"] = "final_dataset\\testA\\image\\9999999.png"
    annotation.write_text(json.dumps(rows))
    with pytest.raises(FileNotFoundError, match=r"row 0: rgb_path file not found: .*9999999.png"):
        affordance.load(source=str(annotation))
    del rows[0]["bbox"]
    annotation.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"row 0: missing bbox; required: text, bbox, rgb_path"):
        affordance.load(source=str(annotation))


# ---------------------------------------------------------------------------------------------- embedded data


@pytest.fixture(scope="module")
def embedded():
    return {split: affordance.load(split) for split in ("train", "test")}


@pytest.fixture(scope="module")
def embedded_rows():
    return {
        split: [json.loads(line) for line in (DATA_DIR / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "test")
    }


QUESTION = re.compile(
    r"Where would you (grasp the (red|green|blue|yellow) mug|press the (red|green|blue|yellow) button"
    r"|place a cup (on the table|(left of|right of|in front of) the (red|green|blue|yellow) (box|mug)))\?"
)


def test_embedded_splits_load(embedded, embedded_rows):
    assert len(embedded["train"]) == 600 and len(embedded["test"]) == 100
    for split, samples in embedded.items():
        assert len({s.id for s in samples}) == len(samples)
        assert {row["kind"] for row in embedded_rows[split]} == {"grasp", "press", "place"}
        for s in samples:
            assert QUESTION.fullmatch(s.question), s.question
            assert s.meta["reference_thought"] and s.meta["width"] == s.meta["height"] == 168
            assert Path(s.images[0]).is_file() and Path(s.answer.mask).is_file()


def test_every_embedded_mask_is_non_empty_and_holds_its_reference_point_and_box(embedded):
    for samples in embedded.values():
        for s in samples:
            mask = affordance.read_mask(s.answer.mask)
            assert mask.shape == (168, 168) and mask.sum() >= make_affordance.MIN_REGION_PIXELS, s.id
            x, y = s.meta["reference_point"]
            assert mask[int(y), int(x)], s.id
            ys, xs = np.nonzero(mask)
            assert s.answer.box == (xs.min(), ys.min(), xs.max() + 1.0, ys.max() + 1.0), s.id
            # the reference point is deep inside: its 3x3 neighbourhood is target too, except for thin handles
            if s.meta["kind"] != "grasp":
                assert mask[int(y) - 1 : int(y) + 2, int(x) - 1 : int(x) + 2].all(), s.id


def test_reference_answers_get_full_reward_in_both_frames(embedded):
    for s in embedded["train"][:100] + embedded["test"]:
        x, y = s.meta["reference_point"]
        text = f"<think>{s.meta['reference_thought']}</think><answer>[({x:.0f}, {y:.0f})]</answer>"
        _assert_parts(
            affordance.reward(_completion(text, original_size=(168, 168), input_size=(168, 168)), s),
            _expected(1.0, True, True),
        )
        # Qwen2-VL / Qwen3-VL: the pixel's centre written in 0-1000
        rx, ry = from_original_pixels(
            [x + 0.5, y + 0.5], CoordinateFrame.RELATIVE_1000, (112, 112), (168, 168)
        )
        text = f"<think>ok</think><answer>[({rx:.4f}, {ry:.4f})]</answer>"
        completion = _completion(text, CoordinateFrame.RELATIVE_1000, (112, 112), (168, 168))
        _assert_parts(affordance.reward(completion, s), _expected(1.0, True, True))


def test_embedded_masks_cover_what_the_question_names(embedded_rows):
    # grasp/press targets are drawn in the named colour; place targets are free table
    for row in embedded_rows["test"]:
        with Image.open(DATA_DIR / row["image"]) as image:
            pixels = np.asarray(image.convert("RGB"))
        with Image.open(DATA_DIR / row["mask"]) as mask_image:
            assert mask_image.mode == "1"
            mask = np.asarray(mask_image)
        under = {tuple(int(c) for c in p) for p in pixels[mask]}
        if row["kind"] == "place":
            assert under == {make_affordance.TABLE_COLOUR}, row["id"]
        else:
            colour = re.search(r"the (\w+) (mug|button)\?$", row["question"]).group(1)
            assert under == {make_affordance.COLOURS[colour]}, row["id"]
            assert row["reference_thought"].startswith(
                f"the {colour} {row['question'].split()[-1][:-1]} is "
            ), row["id"]


def test_embedded_questions_mix_kinds_and_relations(embedded_rows):
    questions = [row["question"] for row in embedded_rows["train"]]
    for phrase in (
        "grasp the",
        "press the",
        "on the table?",
        "left of the",
        "right of the",
        "in front of the",
    ):
        assert sum(phrase in q for q in questions) >= 20, phrase
    assert len({q for q in questions if "grasp" in q or "press" in q}) == 8  # every colour of both nouns


def test_embedded_scenes_hold_distractors(embedded_rows):
    # a press scene always holds 2-3 buttons of different colours; a grasp scene often more than one mug
    for kind, at_least in (("press", 1.0), ("grasp", 0.5)):
        rows = [row for row in embedded_rows["test"] if row["kind"] == kind]
        with_distractor = 0
        for row in rows:
            with Image.open(DATA_DIR / row["image"]) as image:
                colours = {colour for _, colour in image.convert("RGB").getcolors(256)}
            with_distractor += sum(rgb in colours for rgb in make_affordance.COLOURS.values()) >= 2
        assert with_distractor >= at_least * len(rows), kind


def test_embedded_data_is_small():
    total = sum(p.stat().st_size for p in DATA_DIR.rglob("*") if p.is_file())
    assert total < 6_000_000


# ---------------------------------------------------------------------------------------------- generator


def _pixels(path):
    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


def test_generator_is_deterministic(tmp_path):
    first = make_affordance.generate(tmp_path / "a", 6, seed=11, split="train")
    second = make_affordance.generate(tmp_path / "b", 6, seed=11, split="train")
    other = make_affordance.generate(tmp_path / "c", 6, seed=12, split="train")
    assert first == second
    assert first != other
    for row in first:
        for key in ("image", "mask"):
            assert _pixels(tmp_path / "a" / row[key]) == _pixels(tmp_path / "b" / row[key])


def test_embedded_test_split_matches_the_generator(tmp_path, embedded_rows):
    n, seed = make_affordance.SPLIT_SIZES_AND_SEEDS["test"]
    rows = make_affordance.generate(tmp_path, 4, seed=seed, split="test")  # a prefix of the split
    assert rows == embedded_rows["test"][:4]
    for row in rows:
        for key in ("image", "mask"):
            assert _pixels(tmp_path / row[key]) == _pixels(DATA_DIR / row[key])
    assert len(embedded_rows["test"]) == n


def test_write_split_writes_jsonl_the_loader_reads(tmp_path):
    make_affordance.write_split(tmp_path, "test", 3, seed=5)
    samples = affordance.load(source=str(tmp_path / "test.jsonl"))
    assert [s.id for s in samples] == ["test_00000", "test_00001", "test_00002"]
    assert all(Path(s.images[0]).is_file() and Path(s.answer.mask).is_file() for s in samples)


def test_reference_point_is_deep_inside_a_mask():
    mask = _region_mask(12, 10, (2, 3, 9, 8))  # 7 wide, 5 high: two erosions leave row 5, columns 4..6
    assert make_affordance.reference_point(mask) == (5, 5)
    assert make_affordance.tight_box(mask) == (2, 3, 9, 8)


@pytest.mark.parametrize(
    "answer, frame, input_size, expected",
    [
        ("[(30, 20), (50, 60)]", CoordinateFrame.ABSOLUTE_INPUT, (100, 80), {"points": [[30.0, 20.0], [50.0, 60.0]]}),
        ("[(300, 250)]", CoordinateFrame.RELATIVE_1000, (56, 28), {"points": [[30.0, 20.0]]}),
        ("[15, 20, 5, 10]", CoordinateFrame.ABSOLUTE_INPUT, (50, 40), {"box": [10.0, 20.0, 30.0, 40.0]}),
        ("[(1, 2)]" + ", (1, 2)" * 10, CoordinateFrame.ABSOLUTE_INPUT, (100, 80), None),
        ("nothing", CoordinateFrame.ABSOLUTE_INPUT, (100, 80), None),
    ],
)
def test_prediction_is_in_original_pixels(answer, frame, input_size, expected):
    completion = _completion(f"<think>t</think><answer>{answer}</answer>", frame, input_size)
    predicted = affordance.prediction(completion, _sample())
    if expected is None:
        assert predicted is None
    else:
        assert {k: [list(map(pytest.approx, v)) if isinstance(v, list) else pytest.approx(v) for v in vals]
                for k, vals in predicted.items()} == expected


def test_drawing_marks_the_prediction_and_the_target():
    sample = _sample()
    image = Image.new("RGB", (100, 80), (255, 255, 255))
    drawn = affordance.draw(image, sample, {"points": [[70.0, 60.0]]})
    scale = drawn.size[0] / 100
    assert drawn.getpixel((int(30 * scale), int(20 * scale))) != (255, 255, 255)  # inside the target region: tinted
    assert drawn.getpixel((int(70 * scale), int(60 * scale))) == (230, 40, 40)  # the predicted point
    assert drawn.getpixel((int(90 * scale), int(5 * scale))) == (255, 255, 255)  # elsewhere untouched
