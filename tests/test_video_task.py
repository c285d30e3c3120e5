"""The built-in video task (tasks/video.py) and its embedded clips (data/make_video.py): the reward table, each
loader on the fixtures (tests/fixtures/video, written by its make_fixtures.py), the wrong-root error, the
embedded splits, and the generator's answers recomputed from the frames as the trainer decodes them."""

from __future__ import annotations

import itertools
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks import video
from vlm_grpo_ma.task_api import Completion, VideoBudget, decode_video, frame_strip, get_task
from vlm_grpo_ma.task_api.registry import count_load_skips, load_samples

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "video"
sys.path.insert(0, str(ROOT / "data"))

import make_video  # noqa: E402  (data/make_video.py, the embedded generator)

# The trainer's default budget (model.video_fps, video_max_frames, video_max_pixels).
BUDGET = VideoBudget(fps=2.0, max_frames=16, max_pixels=100352)


def completion(text: str) -> Completion:
    return Completion(thought="", answer=text)


@pytest.fixture(scope="module")
def project_samples():
    samples = video.load(source=str(FIXTURES / "project.jsonl"))
    return {sample.id: sample for sample in samples}


# ---------------------------------------------------------------------------------------------- reward

# (completion text, sample: "choice" (answer D = down) or "number" (answer 1), accuracy, format)
REWARD_TABLE = [
    ("<think>it goes down</think><answer>D</answer>", "choice", 1.0, 1.0),
    ("<think>x</think><answer>(D)</answer>", "choice", 1.0, 1.0),
    ("<think>x</think><answer>down</answer>", "choice", 1.0, 1.0),  # the option's text
    ("<think>x</think><answer>D. down</answer>", "choice", 1.0, 1.0),
    ("<think>x</think><answer>A</answer>", "choice", 0.0, 1.0),  # wrong letter: format only
    ("<think>x</think><answer>E</answer>", "choice", 0.0, 1.0),  # past the last option
    ("<think>x</think><answer>A B C D</answer>", "choice", 0.0, 1.0),  # every letter
    ("<think>x</think><answer>C or D</answer>", "choice", 0.0, 1.0),
    ("<think>x</think><answer>C, D</answer>", "choice", 0.0, 1.0),
    ("<think>x</think><answer>CD</answer>", "choice", 0.0, 1.0),
    ("<think>x</think><answer>D. up</answer>", "choice", 0.0, 1.0),  # a label and another option's text
    ("<think>x</think><answer>left right up down</answer>", "choice", 0.0, 1.0),
    ("the answer is <answer>D</answer>", "choice", 1.0, 0.0),  # graded, but not the format
    ("<think>x</think> D", "choice", 0.0, 0.0),  # no answer tag
    ("<think>x</think><answer>D</answer><answer>D</answer>", "choice", 0.0, 0.0),  # two tags
    ("<think>x</think><answer>D", "choice", 0.0, 0.0),  # cut off
    ("<think>x</think><answer> </answer>", "choice", 0.0, 0.0),  # blank
    ("<think>x</think><answer>1</answer>", "number", 1.0, 1.0),
    ("<think>x</think><answer>1.0</answer>", "number", 1.0, 1.0),
    ("<think>x</think><answer>one</answer>", "number", 1.0, 1.0),
    ("<think>x</think><answer>2</answer>", "number", 0.0, 1.0),
    ("<think>x</think><answer>0 1 2 3</answer>", "number", 0.0, 1.0),  # every count
    ("<think>x</think><answer>1, 2</answer>", "number", 0.0, 1.0),
    ("<think>x</think><answer>nan</answer>", "number", 0.0, 1.0),
    ("<answer>1</answer><think>x</think>", "number", 1.0, 0.0),  # tags out of order
    ("", "number", 0.0, 0.0),
]


@pytest.mark.parametrize(("text", "which", "accuracy", "form"), REWARD_TABLE)
def test_reward_table(project_samples, text, which, accuracy, form):
    sample = project_samples["fixture_direction" if which == "choice" else "fixture_crossings"]
    assert sample.answer == ("D" if which == "choice" else "1")  # the fixture clips' answers
    parts = video.reward(completion(text), sample)
    assert (parts["accuracy"], parts["format"]) == (accuracy, form)
    assert parts["reward"] == pytest.approx(accuracy + 0.5 * form)


def test_reward_never_raises_and_parse(project_samples):
    rng = random.Random(0)
    alphabet = "<>/answerthinkABCD0123 .,()[]\n\x00é"
    for sample in project_samples.values():
        for _ in range(300):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
            parts = video.reward(completion(text), sample)
            assert set(parts) == {"reward", "accuracy", "format"}
    sample = project_samples["fixture_direction"]
    assert video.parse(completion("<think>x</think><answer> D </answer>"), sample) == "D"
    assert video.parse(completion("<think>x</think><answer></answer>"), sample) is None
    assert video.parse(completion("no tags"), sample) is None


def test_task_registered():
    task = get_task("video")
    assert task.success == "accuracy" and task.reward_weights == {"accuracy": 1.0, "format": 0.5}
    assert task.draw is video.draw and task.parse is video.parse


# ---------------------------------------------------------------------------------------------- loaders


def test_project_loader(project_samples):
    choice, number = project_samples["fixture_direction"], project_samples["fixture_crossings"]
    assert choice.question.splitlines()[1:] == ["A. left", "B. right", "C. up", "D. down"]
    assert choice.meta["kind"] == "multiple_choice" and choice.meta["choices"] == ("left", "right", "up", "down")
    assert choice.meta["clip_kind"] == "direction" and choice.meta["answer_text"] == "down"
    assert number.meta["kind"] == "short_answer" and number.question == "How many times does the blue circle cross the line?"
    for sample in project_samples.values():
        assert sample.images == () and len(sample.videos) == 1 and Path(sample.videos[0]).is_file()
        assert Path(sample.videos[0]).is_absolute()


def test_video_r1_loader():
    with count_load_skips() as skipped:
        samples = video.load(source=str(FIXTURES / "video_r1.json"))
    assert skipped["unsupported_rows"] == 1  # the regression row
    assert [s.id for s in samples] == ["1", "2", "3", "4", "1#2"]  # the repeated problem_id made unique
    by_id = {s.id: s for s in samples}
    assert by_id["1"].answer == "D" and by_id["1"].meta["choices"] == ("left", "right", "up", "down")
    assert by_id["2"].answer == "1" and by_id["2"].meta["kind"] == "short_answer"
    assert by_id["3"].answer == "STOP" and by_id["3"].videos == () and Path(by_id["3"].images[0]).is_file()
    assert "<image>" not in by_id["3"].question
    assert by_id["4"].answer == "a shape moves across"
    assert by_id["1#2"].answer == "A" and by_id["1#2"].meta["choices"] == ("grey", "pink")
    for sample in samples:
        for path in (*sample.videos, *sample.images):
            assert Path(path).is_file()
    assert video.reward(completion("<think>x</think><answer>stop</answer>"), by_id["3"])["accuracy"] == 1.0


def test_nextqa_loader():
    samples = video.load(source=str(FIXTURES / "nextqa" / "val.csv"))
    assert [s.answer for s in samples] == ["B", "D", "A"]
    assert len({s.id for s in samples}) == 3
    assert samples[0].question.splitlines() == [
        "Which way does the shape move?", "A. up", "B. right", "C. down", "D. left", "E. it stays"
    ]
    for sample in samples:  # found in the CSV's videos/ subfolder
        assert Path(sample.videos[0]).is_file() and Path(sample.videos[0]).parent.name == "videos"
        assert len(sample.meta["choices"]) == 5


def test_wrong_root_is_an_error_at_load(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path.resolve()))):
        video.load(source=str(FIXTURES / "video_r1.json"), video_root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="first missing"):
        video.load(source=str(FIXTURES / "nextqa" / "val.csv"), video_root=str(tmp_path))
    # A few missing files under the right root are the trainer's business (skipped when decoded), not an error.
    rows = [json.loads(line) for line in (FIXTURES / "project.jsonl").read_text().splitlines()]
    rows[0]["video"] = "clips/gone.mp4"
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len(video.load(source=str(source), video_root=str(FIXTURES))) == 2


def test_bad_rows_name_file_row_and_key(tmp_path):
    source = tmp_path / "rows.jsonl"
    good = json.loads((FIXTURES / "project.jsonl").read_text().splitlines()[0])
    source.write_text(json.dumps(good) + "\n" + json.dumps({"id": "a", "question": "q?", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: missing video"):
        video.load(source=str(source), video_root=str(FIXTURES))
    rows = json.loads((FIXTURES / "video_r1.json").read_text())
    del rows[1]["solution"]
    source = tmp_path / "r1.json"
    source.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"r1\.json: row 1: missing solution"):
        video.load(source=str(source), video_root=str(FIXTURES))
    with pytest.raises(ValueError, match="unknown video source format"):
        video.load(source=str(tmp_path / "x.parquet"))


NEXTQA_CSV = (FIXTURES / "nextqa" / "val.csv").read_text().splitlines()


def test_an_unreadable_nextqa_file_is_one_line_naming_file_and_line(tmp_path):
    """Issue 45: a field over csv's 131,072-character limit (an unclosed quote) raised csv.Error, no ValueError,
    so a traceback; a Latin-1 file raised UnicodeDecodeError naming no file. Planted: the CSV read with
    csv.DictReader over open(..., encoding="utf-8-sig") as before; both failed."""
    source = tmp_path / "val.csv"
    source.write_text("\n".join([*NEXTQA_CSV[:2], '7,8,84,84,"what is' + " long" * 30000, *NEXTQA_CSV[2:]]) + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(source))}:3: not a CSV row \(field larger than field"):
        video.load(source=str(source))
    source.write_bytes("\n".join([*NEXTQA_CSV[:2], NEXTQA_CSV[2].replace("colour", "colou\xe9r")]).encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(source))}:3: not UTF-8 text"):
        video.load(source=str(source))


def test_malformed_rows_are_skipped_and_counted_in_one_line(tmp_path, caplog):
    """Issue 45: a short NExT-QA row became a sample with the options "None", a blank option one with a blank
    option, a Video-R1 numerical solution "[1]" and a NaN answer samples no answer can match, a NUL byte in a
    path an error when the trainer opened it. Each row is skipped and counted, and each file logs one line.
    Planted, each alone: the check of the fields against the header removed (the short row became a sample with
    options "None"); _choices without its blank check; the numerical check removed; _short_answer without its
    finiteness check; resolved_path without its NUL check (pathlib's "embedded null byte" at load); the Video-R1
    solution's type check (the list [1] became the free-form answer "[1]"). Each failed."""
    header, good = NEXTQA_CSV[0], NEXTQA_CSV[1:]
    bad = [
        "4010069381,8,84,84,what is drawn,0,5,DL,a line,a dog,a car",  # short: a3, a4 missing
        "4010069381,8,84,84,what is drawn,0,6,DL,a line,,a car,a tree,nothing",  # a blank option
        "4010069381,8,84,84,what is drawn,nan,7,DL,a line,a dog,a car,a tree,nothing",  # answer NaN
        "4010069381,8,84,84,what is drawn,5,8,DL,a line,a dog,a car,a tree,nothing",  # past the last option
        "4010069381\x00x,8,84,84,what is drawn,0,9,DL,a line,a dog,a car,a tree,nothing",  # a NUL byte
        "4010069381,8,84,84,what, if anything, is drawn,0,10,DL,a line,a dog,a car,a tree,nothing",  # two commas
    ]
    source = tmp_path / "val.csv"
    source.write_text("\n".join([header, good[0], *bad, *good[1:]]) + "\n")
    with count_load_skips() as skipped, caplog.at_level("WARNING", logger="vlm_grpo_ma.data"):
        samples = video.load(source=str(source), video_root=str(FIXTURES / "nextqa" / "videos"))
    assert [sample.id for sample in samples] == ["nextqa-4010069381-0", "nextqa-4010069381-1", "nextqa-4010069382-0"]
    assert skipped == {"malformed_rows": 6}
    assert [record.getMessage() for record in caplog.records] == [
        f"6 rows of {source} skipped: 11 fields under a header of 13 (first at {source}:3)"
    ]

    rows = json.loads((FIXTURES / "video_r1.json").read_text())
    numerical, choice = rows[1], rows[0]
    rows += [
        {**numerical, "problem_id": 10, "solution": "<answer>[1]</answer>"},
        {**numerical, "problem_id": 11, "problem_type": "free-form", "solution": [1]},
        {**numerical, "problem_id": 12, "solution": "<answer>NaN</answer>"},
        {**numerical, "problem_id": 13, "problem_type": "OCR", "solution": "<answer>nan</answer>"},
        {**choice, "problem_id": 14, "options": ["A. left", None, "C. up", "D. down"]},
        {**choice, "problem_id": 15, "options": ["A. left", " ", "C. up", "D. down"]},
        {**choice, "problem_id": 16, "path": "./clips/direction.mp4\x00.txt"},
    ]
    source = tmp_path / "r1.json"
    source.write_text(json.dumps(rows))
    caplog.clear()
    with count_load_skips() as skipped, caplog.at_level("WARNING", logger="vlm_grpo_ma.data"):
        samples = video.load(source=str(source), video_root=str(FIXTURES))
    assert [s.id for s in samples] == ["1", "2", "3", "4", "1#2"]
    assert skipped == {"unsupported_rows": 1, "malformed_rows": 7}
    assert sorted(record.getMessage() for record in caplog.records) == [
        f"1 row of {source} skipped: problem_type 'regression' has no exact answer to grade (first at {source}: row 4)",
        f"7 rows of {source} skipped: a numerical solution must be a number, got '[1]' (first at {source}: row 6)",
    ]

    good = json.loads((FIXTURES / "project.jsonl").read_text().splitlines()[1])  # the short answer "1"
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "nan", "answer": float("nan")}) + "\n")
    with count_load_skips() as skipped:
        assert [s.id for s in video.load(source=str(source), video_root=str(FIXTURES))] == [good["id"]]
    assert skipped == {"malformed_rows": 1}
    source.write_text(json.dumps({**good, "id": "nan", "answer": float("nan")}) + "\n")
    every_row = r"rows\.jsonl: every row was skipped \(1 malformed_rows: a short answer must be a finite"
    with pytest.raises(ValueError, match=every_row):
        video.load(source=str(source), video_root=str(FIXTURES))


def test_embedded_splits():
    task = get_task("video")
    for split, size in (("train", 600), ("test", 150)):
        samples = load_samples(task, split)  # the registry's checks too: unique ids, the task's name
        assert len(samples) == size
        kinds = [s.meta["clip_kind"] for s in samples]
        assert {kind: kinds.count(kind) for kind in make_video.KINDS} == {kind: size // 3 for kind in make_video.KINDS}
        assert all(Path(s.videos[0]).is_file() for s in samples[:50])
        for sample in samples:
            if sample.meta["kind"] == "multiple_choice":
                assert sample.answer in "ABCD"[: len(sample.meta["choices"])]
            else:
                assert sample.answer in {"0", "1", "2", "3"}


# ---------------------------------------------------------------------------------------------- generator


def test_make_clip_is_seeded():
    for kind in (*make_video.KINDS, None):
        first, second = make_video.make_clip(random.Random(7), kind), make_video.make_clip(random.Random(7), kind)
        assert all(np.array_equal(a, b) for a, b in zip(first.frames, second.frames, strict=True))
        assert (first.question, first.answer, first.choices, first.objects) == (
            second.question, second.answer, second.choices, second.objects
        )
    rng = random.Random(3)
    for _ in range(30):
        clip = make_video.make_clip(rng)
        assert len(clip.frames) == 8 and clip.frames[0].shape == (84, 84, 3) and clip.frames[0].dtype == np.uint8
        assert 6 <= len(clip.reference_thought.split()) <= 16, clip.reference_thought


def test_write_clip_is_reproducible(tmp_path):
    clip = make_video.make_clip(random.Random(11), "crossings")
    a = make_video.write_clip(tmp_path / "a.mp4", clip.frames)
    b = make_video.write_clip(tmp_path / "b.mp4", clip.frames)
    assert a.read_bytes() == b.read_bytes()


def _centroids(frame) -> dict[str, tuple[float, float]]:
    """Each shape colour's centroid (x, y) in a decoded [3, H, W] frame; colours under 30 pixels are absent."""
    pixels = frame.permute(1, 2, 0).numpy().astype(int)
    found = {}
    for name, rgb in make_video.COLOURS.items():
        mask = np.abs(pixels - np.array(rgb)).sum(axis=-1) < 90
        if mask.sum() >= 30:
            ys, xs = np.nonzero(mask)
            found[name] = (float(xs.mean()), float(ys.mean()))
    return found


def _named_colour(text: str) -> str:
    return re.search(r"the (red|green|blue|yellow) (?:circle|square|triangle)", text).group(1)


def _answer_from_frames(row: dict, frames) -> str:
    """The answer recomputed from the decoded frames alone (and the question's words)."""
    seen = [_centroids(frame) for frame in frames]
    if row["kind"] == "direction":
        colour = _named_colour(row["question"])
        (x0, y0), (x1, y1) = seen[0][colour], seen[-1][colour]
        dx, dy = x1 - x0, y1 - y0
        way = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
        return "ABCD"[row["choices"].index(way)]
    if row["kind"] == "first":
        colours = [_named_colour(choice) for choice in row["choices"]]
        assert all(colour in seen[-1] for colour in colours)  # both shown at the end
        present = [colour in seen[0] for colour in colours]
        assert sum(present) == 1
        return "AB"[present.index(True)]
    colour = _named_colour(row["question"])
    offsets = [seen_t[colour][0] - make_video.LINE_X for seen_t in seen]
    assert all(abs(offset) >= 8 for offset in offsets)  # clearly on one side in every frame
    return str(sum(np.sign(a) != np.sign(b) for a, b in itertools.pairwise(offsets)))


def test_generated_answers_agree_with_the_decoded_frames(tmp_path):
    rng = random.Random(2024)
    kinds = [make_video.KINDS[i % 3] for i in range(30)]
    answers = {kind: set() for kind in make_video.KINDS}
    for index, kind in enumerate(kinds):
        clip = make_video.make_clip(rng, kind)
        path = make_video.write_clip(tmp_path / f"{index}.mp4", clip.frames, clip.fps)
        row = make_video.clip_row(clip, str(index), path.name)
        decoded = decode_video(str(path), BUDGET)
        assert tuple(decoded.frames.shape) == (8, 3, 84, 84) and decoded.cut == ""
        assert _answer_from_frames(row, decoded.frames) == row["answer"], (index, row)
        answers[kind].add(row["answer"])
    assert all(len(values) >= 2 for values in answers.values())  # the check saw more than one answer per kind


def test_draw_adds_a_text_band(project_samples):
    sample = project_samples["fixture_direction"]
    strip = frame_strip(decode_video(sample.videos[0], BUDGET))
    for prediction in ("D", None, "x" * 500):
        drawn = video.draw(strip, sample, prediction)
        assert drawn.width == strip.width and drawn.height > strip.height
        assert np.array_equal(np.asarray(drawn)[: strip.height], np.asarray(strip.convert("RGB")))


def test_committed_clips_agree_with_their_rows():
    """The first clips of the embedded test split, as committed, against their rows (the generator and the files
    in step)."""
    path = ROOT / "data" / "video" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:12]]
    assert {row["kind"] for row in rows} == set(make_video.KINDS)
    for row in rows:
        decoded = decode_video(str(path.parent / row["video"]), BUDGET)
        assert _answer_from_frames(row, decoded.frames) == row["answer"], row
