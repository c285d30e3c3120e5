"""The open VQA task (judged answers): embedded data and its generator, the reward parts, what the judge is
asked, the warm-start target, and rows a source file gets wrong."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from tasks import vqa_open
from vlm_grpo_ma.task_api import JudgeQuery, extract_tag
from vlm_grpo_ma.task_api.registry import Completion, Sample, count_load_skips, get_task, load_samples

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "vqa_open"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_vqa_open", REPO / "data" / "make_vqa_open.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sample() -> Sample:
    return Sample(task="vqa_open", id="s0", question="What is unusual in this picture?", images=("/data/s0.png",),
                  answer=("the red circle", "one circle is red while the others are blue"), meta={"thought": "one is red"})  # fmt: skip


def _completion(text: str, judgement: float | None = None) -> Completion:
    # Split where the policy would: the thought runs up to and including "</think>".
    cut = text.index("</think>") + len("</think>") if "</think>" in text else len(text)
    return Completion(thought=text[:cut], answer=text[cut:], judgement=judgement)


def _pixels(path: Path) -> bytes:
    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


# ---------------------------------------------------------------------------------------------- data


def test_embedded_splits_load_with_their_images():
    task = get_task("vqa_open")
    assert (
        task.judge_query is vqa_open.judge_query
        and task.target is vqa_open.target
        and task.success == "accuracy"
    )
    for split, count in (("train", 64), ("test", 24)):
        samples = load_samples(task, split)
        assert len(samples) == count and len({s.id for s in samples}) == count
        assert {s.meta["kind"] for s in samples} == set(_load_generator().KINDS)
        for sample in samples:
            assert isinstance(sample.images[0], str) and Path(sample.images[0]).is_absolute()
            with Image.open(sample.images[0]) as image:
                assert image.size == (112, 112)
            assert isinstance(sample.answer, tuple) and len(sample.answer) >= 3
            assert all(isinstance(reference, str) and reference.strip() for reference in sample.answer)
            assert sample.meta["thought"]
    with pytest.raises(ValueError, match="unknown vqa_open split 'val'; embedded splits: train, test"):
        vqa_open.load("val")
    # the embedded set stays small (it is committed)
    assert sum(path.stat().st_size for path in DATA.rglob("*") if path.is_file()) < 1_000_000


def test_the_generator_rewrites_the_committed_files(tmp_path):
    _load_generator().main(["--out-dir", str(tmp_path)])
    for split in ("train", "test"):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (DATA / f"{split}.jsonl").read_bytes()
    made = sorted(path.name for path in (tmp_path / "images").iterdir())
    assert made == sorted(path.name for path in (DATA / "images").iterdir())
    for name in made:
        assert _pixels(tmp_path / "images" / name) == _pixels(DATA / "images" / name), name


# ---------------------------------------------------------------------------------------------- reward


T = "<think>four circles are blue, one is red</think>"


@pytest.mark.parametrize(
    "text, judgement, accuracy, format_ok",
    [
        (f"{T}<answer>the red circle</answer>", 1.0, 1.0, 1.0),
        (f"{T}<answer>a red circle</answer>", 0.5, 0.5, 1.0),  # a score judge's partial verdict
        (f"{T}<answer>the red circle</answer>", None, 0.0, 1.0),  # the judge gave no verdict
        (f"{T}<answer>the blue circle</answer>", 0.0, 0.0, 1.0),
        ("<answer>the red circle</answer>", 1.0, 1.0, 0.0),  # graded without the format
        # a forged judgement cannot pay without an answer the judge was asked about
        (f"{T}the red circle", 1.0, 0.0, 0.0),
        (f"{T}<answer>the red circle</answer><answer>x</answer>", 1.0, 0.0, 0.0),
        (f"{T}<answer>the red circle", 1.0, 0.0, 0.0),  # cut off
        (f"{T}<answer> \n </answer>", 1.0, 0.0, 0.0),
    ],
)
def test_reward_parts(text, judgement, accuracy, format_ok):
    parts = vqa_open.reward(_completion(text, judgement), _sample())
    assert parts == {"accuracy": accuracy, "format": format_ok, "reward": accuracy + 0.5 * format_ok}


@pytest.mark.parametrize(
    "text",
    [
        f"{T}the red circle",
        f"{T}<answer>a</answer><answer>b</answer>",
        f"{T}<answer>the red circle",
        f"{T}<answer>  </answer>",
    ],
)
def test_judge_query_asks_nothing_without_a_single_non_blank_answer_tag(text):
    assert vqa_open.judge_query(_completion(text), _sample()) is None


def test_judge_query_fields():
    sample = _sample()
    query = vqa_open.judge_query(_completion(f"{T}<answer>the red one</answer>"), sample)
    assert query == JudgeQuery(question="What is unusual in this picture?",
                               references=("the red circle", "one circle is red while the others are blue"),
                               answer="the red one", image="/data/s0.png")  # fmt: skip
    text_only = Sample(task="vqa_open", id="s1", question="Q?", images=(), answer=("a",))
    assert vqa_open.judge_query(_completion("<answer>a</answer>"), text_only).image is None
    assert vqa_open.prediction(_completion(f"{T}<answer> the red one </answer>"), sample) == {
        "answer": "the red one"
    }


def test_target_is_well_formed_and_answers_with_the_first_reference():
    for sample in vqa_open.load("test"):
        text = vqa_open.target(sample)
        assert extract_tag(text, "answer") == sample.answer[0]
        assert extract_tag(text, "think") == sample.meta["thought"]
        assert vqa_open.reward(_completion(text, 1.0), sample) == {
            "accuracy": 1.0,
            "format": 1.0,
            "reward": 1.5,
        }
    bare = Sample(task="vqa_open", id="s1", question="Q?", images=(), answer=("a",))
    assert vqa_open.target(bare) == f"<think>{vqa_open.DEFAULT_THOUGHT}</think><answer>a</answer>"


# ---------------------------------------------------------------------------------------------- sources


def test_bad_source_rows_are_skipped_and_counted(tmp_path):
    (tmp_path / "images").mkdir()
    shutil.copy(DATA / "images" / "test_00000.png", tmp_path / "images" / "a.png")
    good = {"id": "a", "image": "images/a.png", "question": "What is unusual?", "references": ["the red one"]}
    rows = [
        good,
        {key: value for key, value in good.items() if key != "references"} | {"id": "no_references"},
        {**good, "id": "no_image", "image": "images/missing.png"},
        {**good, "id": "blank_reference", "references": ["the red one", " "]},
        {**good, "id": "references_text", "references": "the red one"},
        {**good, "id": "nul", "image": "images/a.png\x00.txt"},  # no file system allows it
        {**good, "id": "b", "thought": "one is red"},
    ]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with count_load_skips() as skipped:
        samples = vqa_open.load(source=str(source))
    assert [s.id for s in samples] == ["a", "b"]
    assert skipped == {"malformed_rows": 4, "broken_images": 1}
    assert samples[0].images == (str(tmp_path / "images" / "a.png"),) and samples[0].answer == (
        "the red one",
    )
    assert samples[0].meta == {} and samples[1].meta == {"thought": "one is red"}
    source.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(
        ValueError, match=r"rows\.jsonl: every row was skipped \(1 malformed_rows: missing references"
    ):
        vqa_open.load(source=str(source))
    with pytest.raises(ValueError, match=r"unknown vqa_open source format '\.json'"):
        vqa_open.load(source=str(tmp_path / "rows.json"))
