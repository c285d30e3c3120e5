"""The VQA task: reward tables (both answer kinds, malformed output included), loaders, easy-vqa offline."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tasks import vqa
from vlm_grpo_ma.task_api.registry import Completion, Sample, get_task

EXACT = 1e-12
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vqa"


def _choice_sample(choices=("cat", "dog", "fish", "3"), answer="B", precision=None) -> Sample:
    return Sample(
        task="vqa",
        id="mc",
        question=vqa.question_with_choices("Which animal barks?", choices),
        images=(),
        answer=answer,
        meta={"kind": "multiple_choice", "choices": tuple(choices), "precision": precision, "source": "test"},
    )


def _short_sample(answer="3", precision=None) -> Sample:
    return Sample(
        task="vqa",
        id="sa",
        question="How many?",
        images=(),
        answer=answer,
        meta={"kind": "short_answer", "precision": precision, "source": "test"},
    )


def _completion(text):
    # Split where the policy would: the thought runs up to and including "</think>".
    cut = text.index("</think>") + len("</think>") if "</think>" in text else len(text)
    return Completion(thought=text[:cut], answer=text[cut:])


def _expected(accuracy, format_ok):
    return {"accuracy": float(accuracy), "format": float(format_ok), "reward": accuracy + 0.5 * format_ok}


def _assert_parts(parts, expected):
    assert set(parts) == set(expected)
    for name, value in expected.items():
        assert parts[name] == pytest.approx(value, abs=EXACT, rel=0), name


T = "<think>it barks, so it is a dog</think>"


def _answer(inner):
    return f"{T}<answer>{inner}</answer>"


# Options A. cat  B. dog  C. fish  D. 3; the right one is B.
CHOICE_TABLE = [
    ("letter", "B", 1),
    ("letter in parentheses", "(B)", 1),
    ("letter with period", "B.", 1),
    ("letter in brackets", "[B]", 1),
    ("letter with closing parenthesis", "B)", 1),
    ("letter with colon", "B:", 1),
    ("letter with spaces", "  B \n", 1),
    ("option text", "dog", 1),
    ("option text, capitalised with period", "Dog.", 1),
    ("option text with article", "a dog", 1),
    ("labelled option", "B. dog", 1),
    ("labelled option in parentheses", "(B) dog", 1),
    ("labelled option with colon", "B: Dog", 1),
    ("wrong letter", "A", 0),
    ("wrong letter in parentheses", "(C)", 0),
    ("wrong option text", "cat", 0),
    ("letter of one option, text of another", "B. cat", 0),
    ("letter with text of no option", "B. wolf", 0),
    ("letter past the last option", "E", 0),
    ("letter past the last option with text", "E. dog", 0),
    ("two letters with comma", "A, B", 0),
    ("two letters with and", "B and C", 0),
    ("two letters joined", "AB", 0),
    ("two letters in parentheses", "(A)(B)", 0),
    ("lower-case letter is not a letter", "b", 0),
    ("plural of the option", "dogs", 0),
    ("two option texts", "dog or cat", 0),
    ("a sentence", "The answer is B.", 0),
    # the numeric option D = "3" is matched as a number
    ("numeric option as word names D", "three", 0),
    ("letter then text separated by a space only is read as text", "B dog", 0),
]


@pytest.mark.parametrize(
    ("inner", "accuracy"), [r[1:] for r in CHOICE_TABLE], ids=[r[0] for r in CHOICE_TABLE]
)
def test_multiple_choice_reward_table(inner, accuracy):
    _assert_parts(vqa.reward(_completion(_answer(inner)), _choice_sample()), _expected(accuracy, True))


def test_numeric_option_text_is_compared_as_a_number():
    sample = _choice_sample(answer="D")
    for inner, accuracy in [("3", 1), ("three", 1), ("3.0", 1), ("D", 1), ("D. 3", 1), ("D. 4", 0), ("4", 0)]:
        assert vqa.reward(_completion(_answer(inner)), sample)["accuracy"] == accuracy, inner


def test_numeric_options_ignore_the_benchmark_precision():
    # MathVista-style: options 1.5 / 2.5 / 3.5 with precision 1, right answer B = 2.5. An option is a value
    # to name: 2.54 would round to 2.5 but names no option.
    sample = _choice_sample(choices=("1.5", "2.5", "3.5"), answer="B", precision=1)
    for inner, accuracy in [("2.5", 1), ("2.50", 1), ("5/2", 1), ("(B) 2.5", 1), ("2.54", 0), ("1.5", 0)]:
        assert vqa.reward(_completion(_answer(inner)), sample)["accuracy"] == accuracy, inner


def test_options_that_are_letters_are_ambiguous_unless_the_readings_agree():
    # options A. "B"  B. "A"; the right one is A (text "B"). "A" read as a letter is option A, read as
    # text it is option B: two readings that disagree are wrong. "A. B" names option A both ways.
    sample = _choice_sample(choices=("B", "A"), answer="A")
    assert vqa.reward(_completion(_answer("A")), sample)["accuracy"] == 0.0
    assert vqa.reward(_completion(_answer("B")), sample)["accuracy"] == 0.0
    assert vqa.reward(_completion(_answer("A. B")), sample)["accuracy"] == 1.0
    assert vqa.reward(_completion(_answer("B. A")), sample)["accuracy"] == 0.0
    # options E / F: "F" is past the last letter (B) but it is the text of option B, the right one
    sample = _choice_sample(choices=("E", "F"), answer="B")
    assert vqa.reward(_completion(_answer("F")), sample)["accuracy"] == 1.0


SHORT_TABLE = [
    # (case, ground truth, precision, answer text, accuracy)
    ("word", "rectangle", None, "rectangle", 1),
    ("word, capitalised with period", "rectangle", None, "Rectangle.", 1),
    ("word with article", "rectangle", None, "a rectangle", 1),
    ("word upper case with spaces", "rectangle", None, "  RECTANGLE \t", 1),
    ("plural", "rectangle", None, "rectangles", 0),
    ("other word", "rectangle", None, "square", 0),
    ("yes with punctuation", "yes", None, "Yes!", 1),
    ("no for yes", "yes", None, "no", 0),
    ("yes and no", "yes", None, "yes, no", 0),
    ("None for no", "no", None, "None", 0),
    ("number", "3", None, "3", 1),
    ("number with decimals", "3", None, "3.0", 1),
    ("number word", "3", None, "three", 1),
    ("number word capitalised with period", "3", None, "Three.", 1),
    ("number with plus sign", "3", None, "+3", 1),
    ("number with trailing period", "3", None, "3.", 1),
    ("negative number", "3", None, "-3", 0),
    ("off by one", "3", None, "4", 0),
    ("within relative 1e-6", "3", None, "3.000001", 1),  # |diff| / 3 = 3.3e-7
    ("outside relative 1e-6", "3", None, "3.00001", 0),  # 3.3e-6
    ("number with unit", "3", None, "3 cubes", 0),
    ("None for a number", "3", None, "None", 0),
    ("nan", "3", None, "nan", 0),
    ("NaN", "3", None, "NaN", 0),
    ("inf", "3", None, "inf", 0),
    ("overflowing literal", "3", None, "1e999", 0),
    ("thousands separators", "1000000", None, "1,000,000", 1),
    ("large number within 1e-6", "1000000", None, "1000000.5", 1),  # 5e-7
    ("large number outside 1e-6", "1000000", None, "1000002", 0),  # 2e-6
    ("exponent", "1000000", None, "1e6", 1),
    ("fraction", "0.5", None, "1/2", 1),
    ("leading decimal point", "0.5", None, ".5", 1),
    ("fraction is not its digits", "12", None, "1/2", 0),
    ("zero", "0", None, "zero", 1),
    ("negative zero", "0", None, "-0", 1),
    ("zero is only exactly zero", "0", None, "1e-9", 0),
    ("precision 1, rounds down to truth", "1.5", 1, "1.54", 1),
    ("precision 1, rounds up to truth", "1.5", 1, "1.46", 1),
    ("precision 1, rounds to 1.6", "1.5", 1, "1.56", 0),
    ("precision 1, rounds to 1.4", "1.5", 1, "1.44", 0),
    ("precision 1, just inside half a unit", "1.5", 1, "1.549", 1),
    ("precision 1, just outside half a unit", "1.5", 1, "1.551", 0),
    ("precision 1, just inside below", "1.5", 1, "1.451", 1),
    ("precision 1, just outside below", "1.5", 1, "1.449", 0),
    ("precision 1, trailing zero", "1.5", 1, "1.50", 1),
    ("precision 1, fraction", "1.5", 1, "3/2", 1),
    ("precision 0", "3", 0, "3.4", 1),
    ("precision 0, below", "3", 0, "2.6", 1),
    ("precision 0, rounds to 4", "3", 0, "3.6", 0),
    ("precision 0, just outside", "3", 0, "3.51", 0),
    ("precision 2", "3.14", 2, "3.1416", 1),
    ("precision 2, too coarse", "3.14", 2, "3.1", 0),
    ("number words inside text", "2 dogs", None, "two dogs", 1),
    ("non-ascii word", "café", None, "Café", 1),
]


@pytest.mark.parametrize(
    ("truth", "precision", "inner", "accuracy"), [r[1:] for r in SHORT_TABLE], ids=[r[0] for r in SHORT_TABLE]
)
def test_short_answer_reward_table(truth, precision, inner, accuracy):
    parts = vqa.reward(_completion(_answer(inner)), _short_sample(truth, precision))
    _assert_parts(parts, _expected(accuracy, True))


HUGE = "3 " * 50_000
MALFORMED_TABLE = [
    # (case, text, accuracy, format)
    ("empty", "", 0, False),
    ("no tags", "3", 0, False),
    ("no tags, huge text", HUGE, 0, False),
    ("only think", "<think>3</think>", 0, False),
    ("empty answer", T + "<answer></answer>", 0, False),
    ("blank answer", T + "<answer>  \n </answer>", 0, False),
    ("truncated answer", T + "<answer>3", 0, False),
    ("two answer tags", T + "<answer>3</answer><answer>3</answer>", 0, False),
    ("two answers in one tag", T + "<answer>3 4</answer>", 0, True),
    ("closing before opening", T + "</answer>3<answer>", 0, False),
    ("huge answer", T + f"<answer>{HUGE}</answer>", 0, True),
    ("unicode garbage", T + "<answer>\x00\uffff\u200b漢字🙂</answer>", 0, True),
    ("NaN", T + "<answer>NaN</answer>", 0, True),
    ("None", T + "<answer>None</answer>", 0, True),
    # an answer in a single tag is graded; the format part is what is lost
    ("answer without think", "<answer>3</answer>", 1, False),
    ("text before", "Sure! " + _answer("3"), 1, False),
    ("text after", _answer("3") + " Done.", 1, False),
    ("two think tags", T + _answer("3"), 1, False),
    ("answer inside think", "<think><answer>3</answer></think>", 1, False),
    ("well formed", _answer("3"), 1, True),
]


@pytest.mark.parametrize(
    ("text", "accuracy", "format_ok"), [r[1:] for r in MALFORMED_TABLE], ids=[r[0] for r in MALFORMED_TABLE]
)
def test_malformed_output_table(text, accuracy, format_ok):
    _assert_parts(vqa.reward(_completion(text), _short_sample("3")), _expected(accuracy, format_ok))


def test_reward_never_raises_on_garbage():
    garbage = [
        "<answer>",
        "</answer><answer>",
        "<think><answer>",
        "(" * 10000,
        "\ud800",
        "<answer>\ud800</answer>",
    ]
    garbage += ["<answer>" + "(" * 5000 + "</answer>", "<answer>B" * 3, "<answer>" + "9" * 5000 + "</answer>"]
    garbage += ["<answer>" + "1/" + "0" * 400 + "</answer>", "<answer>1" + "0" * 400 + "/1</answer>"]
    garbage += ["<answer>" + "7" * 5000 + "/3</answer>", "<answer>inf/inf</answer>", "<answer>0/0</answer>"]
    # long whitespace runs inside letter-like answers (a regex with adjacent \s* would backtrack for minutes)
    garbage += ["<answer>B" + " " * 30000 + "x</answer>", "<answer>(B." + " \t" * 15000 + ")x</answer>"]
    for text in garbage:
        for sample in (_choice_sample(), _short_sample("3"), _short_sample("1.5", 1)):
            parts = vqa.reward(_completion(text), sample)
            assert set(parts) == {"reward", "accuracy", "format"}
            assert parts["accuracy"] == 0.0


AS_NUMBER_TABLE = [
    ("3", 3.0), (" -2.5 ", -2.5), ("1,234.5", 1234.5), ("1e3", 1000.0), ("Twelve", 12.0), ("ninety", 90.0),
    ("3/4", 0.75), ("3.", 3.0), ("1,23", None), ("1/0", None), ("nan", None), ("-inf", None), ("1e999", None),
    ("3 m", None), ("$3", None), ("", None), ("three hundred", None), ("1" + "0" * 400 + "/1", None), ("9" * 5000 + "/3", None), ("-6 / 4", -1.5),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), AS_NUMBER_TABLE)
def test_as_number(text, expected):
    assert vqa.as_number(text) == expected


def test_truths_that_normalise_to_nothing_are_compared_as_written():
    # the option "A" is an article to normalise_answer; "the" must not match it, " a " does
    assert vqa.answers_match(" a ", "A") and vqa.answers_match("A", "A")
    assert not vqa.answers_match("the", "A") and not vqa.answers_match("", "A")
    assert not vqa.answers_match("?", "!") and vqa.answers_match("?", "?")
    assert not vqa.answers_match("", "dog") and not vqa.answers_match("   ", "")


def test_normalise_short():
    assert vqa.normalise_short("  The Three  little PIGS! ") == "3 little pigs"
    assert vqa.normalise_short("An answer: 2.5, I think.") == "answer 2.5 i think"
    assert vqa.normalise_short("...") == ""


def test_task_is_registered():
    task = get_task("vqa")
    assert task is vqa.TASK
    assert task.load is vqa.load and task.reward is vqa.reward
    assert task.metrics == ("accuracy", "format")
    assert task.reward_weights == {"accuracy": 1.0, "format": 0.5}
    assert "<think></think>" in task.instruction and "<answer></answer>" in task.instruction


def test_question_lists_the_choices_with_letters():
    text = vqa.question_with_choices(" Which one? ", ["cat ", "dog"], context="Look closely.")
    assert text == "Context: Look closely.\nWhich one?\nA. cat\nB. dog"
    assert vqa.question_with_choices("Q?", []) == "Q?"


# ---------------------------------------------------------------------------------------------- loaders


def _size(image):
    if isinstance(image, Image.Image):
        return image.size
    with Image.open(image) as opened:
        return opened.size


def test_load_project_jsonl():
    samples = vqa.load(source=str(FIXTURES / "project.jsonl"))
    assert [s.id for s in samples] == ["p1", "p2", "p3"]
    p1, p2, p3 = samples
    assert p1.question == "What colour is the square?\nA. blue\nB. red\nC. green"
    assert p1.answer == "B"
    assert p1.meta == {"kind": "multiple_choice", "choices": ("blue", "red", "green"), "answer_text": "red",
                       "source": "project", "precision": None}  # fmt: skip
    assert p1.images == (str(FIXTURES / "images" / "red.png"),)
    assert (
        p2.question == "How many squares are there in total?" and p2.answer == "2"
    )  # a number becomes a string
    assert p2.images == (str(FIXTURES / "images" / "red.png"), str(FIXTURES / "images" / "blue.png"))
    assert [_size(i) for i in p2.images] == [(3, 2), (2, 3)]
    assert p2.meta == {"kind": "short_answer", "source": "project", "precision": None}
    assert p3.images == () and p3.answer == "3.14" and p3.meta["precision"] == 2
    assert all(s.task == "vqa" for s in samples)


def test_project_answer_may_be_text_letter_or_index(tmp_path):
    rows = [
        {"id": 1, "question": "Q?", "choices": ["x", "y", "z"], "answer": "z"},
        {"id": 2, "question": "Q?", "choices": ["x", "y", "z"], "answer": "B"},
        {"id": 3, "question": "Q?", "choices": ["x", "y", "z"], "answer": 0},
        {"id": 4, "question": "Q?", "choices": ["B", "A"], "answer": "A"},  # option text wins over a letter
        {"id": 5, "question": "Q?", "choices": [], "answer": "x", "image": ""},  # no choices: short answer
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    samples = vqa.load(source=str(path))
    assert [s.answer for s in samples] == ["C", "B", "A", "B", "x"]
    assert [s.meta["kind"] for s in samples] == ["multiple_choice"] * 4 + ["short_answer"]
    assert samples[4].images == ()


def test_image_root_replaces_the_file_folder(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": "a", "image": "red.png", "question": "Q?", "answer": "red"}) + "\n")
    samples = vqa.load(source=str(path), image_root=str(FIXTURES / "images"))
    assert samples[0].images == (str(FIXTURES / "images" / "red.png"),)
    assert vqa.load(source=str(path))[0].images == (str(tmp_path / "red.png"),)


def test_load_scienceqa_parquet():
    samples = vqa.load("validation", str(FIXTURES / "scienceqa.parquet"))  # split is ignored for a file
    assert [s.id for s in samples] == ["scienceqa_0", "scienceqa_1", "scienceqa_2"]
    first, text_only, third = samples
    assert (
        first.question == "Context: Look at the picture.\nWhich animal is a mammal?\nA. fish\nB. cat\nC. frog"
    )
    assert first.answer == "B" and first.meta["answer_text"] == "cat"
    assert first.meta["choices"] == ("fish", "cat", "frog")
    assert first.meta["subject"] == "natural science" and first.meta["grade"] == "grade4"
    assert "lecture" not in first.meta and "solution" not in first.meta
    assert len(first.images) == 1 and _size(first.images[0]) == (3, 2)
    assert first.images[0].convert("RGB").getpixel((0, 0)) == (10, 20, 30)
    assert text_only.images == () and text_only.question == "Which word is a noun?\nA. run\nB. table"
    assert _size(third.images[0]) == (2, 2)  # bytes win over the cell's path
    assert all(s.meta["kind"] == "multiple_choice" and s.meta["source"] == "scienceqa" for s in samples)


def test_load_scienceqa_problems_json_filters_by_split():
    train = vqa.load("train", str(FIXTURES / "scienceqa_problems.json"))
    assert [s.id for s in train] == ["10", "11"]
    assert train[0].images == (str(FIXTURES / "images" / "train" / "10" / "image.png"),)
    assert _size(train[0].images[0]) == (4, 2)
    assert train[0].answer == "A" and train[0].question == "Which colour is shown?\nA. green\nB. red"
    assert train[1].images == () and train[1].question.startswith("Context: Pick one.\nWhich is a fruit?")
    test = vqa.load("test", str(FIXTURES / "scienceqa_problems.json"))
    assert [s.id for s in test] == ["12"] and test[0].meta["answer_text"] == "Mars"
    with pytest.raises(ValueError, match=r"split 'val'; splits in the file: test, train"):
        vqa.load("val", str(FIXTURES / "scienceqa_problems.json"))


def test_load_mathvista_parquet_keeps_multi_choice_rows_only():
    samples = vqa.load(source=str(FIXTURES / "mathvista.parquet"))
    assert [s.id for s in samples] == ["1", "3"]  # pid 2 is free_form
    shape, number = samples
    assert shape.question == "Which shape is red?\nA. circle\nB. square"
    assert shape.answer == "B" and shape.meta["answer_text"] == "square"
    assert shape.meta["precision"] is None and shape.meta["answer_type"] == "text"
    assert shape.meta["query"].startswith("Hint: Please answer the question and provide the correct option")
    assert _size(shape.images[0]) == (3, 3)  # from decoded_image bytes, not the missing images/1.jpg
    assert number.answer == "B" and number.meta["choices"] == ("1.5", "2.5", "3.5", "4.5")
    assert number.meta["precision"] == 1 and number.meta["source"] == "mathvista"


def test_load_mathvista_json_reads_image_paths():
    samples = vqa.load(source=str(FIXTURES / "mathvista_testmini.json"))
    assert [s.id for s in samples] == ["7"]
    assert samples[0].images == (str(FIXTURES / "images" / "blue.png"),)
    assert samples[0].answer == "A" and samples[0].question == "Is the square blue?\nA. yes\nB. no"


def test_load_r1v_clevr_parquet():
    samples = vqa.load(source=str(FIXTURES / "clevr_r1v.parquet"))
    assert [s.id for s in samples] == ["clevr_r1v_0", "clevr_r1v_1"]
    assert [s.answer for s in samples] == ["3", "10"]
    assert [s.question for s in samples] == [
        "How many items are there in the image?",
        "How many cubes are there?",
    ]
    assert [_size(s.images[0]) for s in samples] == [(3, 2), (2, 2)]
    assert all(s.meta == {"kind": "short_answer", "source": "r1v_clevr", "precision": None} for s in samples)
    # the ground truth reads back through the reward
    parts = vqa.reward(_completion(_answer("three")), samples[0])
    _assert_parts(parts, _expected(1, True))


def test_r1v_clevr_json_with_untagged_solution(tmp_path):
    rows = [{"image": "red.png", "problem": "How many?", "solution": " 4 "}]
    path = tmp_path / "clevr.json"
    path.write_text(json.dumps(rows))
    samples = vqa.load(source=str(path))
    assert samples[0].answer == "4" and samples[0].images == (str(tmp_path / "red.png"),)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_rejects_bad_sources(tmp_path):
    with pytest.raises(ValueError, match=r"'validation'.*train, test"):
        vqa.load("validation")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.jsonl, \.json, \.parquet"):
        vqa.load(source=str(tmp_path / "questions.csv"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        vqa.load(source=str(tmp_path / "missing.jsonl"))
    other = _write_jsonl(tmp_path / "other.jsonl", [{"text": "hi", "label": 1}])
    with pytest.raises(
        ValueError, match=r"unrecognised vqa columns label, text;.*project: id, question, answer"
    ):
        vqa.load(source=other)
    parquet = tmp_path / "other.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), parquet)
    with pytest.raises(
        ValueError, match=r"unrecognised vqa columns answer, question;.*scienceqa: question, choices"
    ):
        vqa.load(source=str(parquet))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no rows"):
        vqa.load(source=str(tmp_path / "empty.jsonl"))
    (tmp_path / "scalar.json").write_text("3")
    with pytest.raises(ValueError, match="list of rows or a dict of rows keyed by id, got int"):
        vqa.load(source=str(tmp_path / "scalar.json"))
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", [{"id": 1, "question": "q", "answer": "a"}, [1, 2]])
    with pytest.raises(ValueError, match=r"mixed.jsonl:2: a row must be a JSON object, got list"):
        vqa.load(source=mixed)
    (tmp_path / "broken.jsonl").write_text(
        json.dumps({"id": 1, "question": "q", "answer": "a"}) + "\n{oops\n"
    )
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not JSON"):
        vqa.load(source=str(tmp_path / "broken.jsonl"))


def test_load_rejects_bad_rows(tmp_path):
    row = {"id": 1, "question": "q", "answer": "a"}
    missing = _write_jsonl(tmp_path / "missing.jsonl", [row, {"id": 2, "answer": "a"}])
    with pytest.raises(
        ValueError, match=r"missing.jsonl:2: missing question; required: id, question, answer"
    ):
        vqa.load(source=missing)
    not_a_choice = _write_jsonl(tmp_path / "choice.jsonl", [{**row, "choices": ["x", "y"], "answer": "w"}])
    with pytest.raises(
        ValueError, match=r"choice.jsonl:1: answer 'w' is not one of the choices.*A/0/'x', B/1/'y'"
    ):
        vqa.load(source=not_a_choice)
    index = _write_jsonl(tmp_path / "index.jsonl", [{**row, "choices": ["x", "y"], "answer": 2}])
    with pytest.raises(ValueError, match=r"answer 2 is not one of the choices"):
        vqa.load(source=index)
    one = _write_jsonl(tmp_path / "one.jsonl", [{**row, "choices": ["x"]}])
    with pytest.raises(ValueError, match=r"at least 2 options, got \['x'\]"):
        vqa.load(source=one)
    many = _write_jsonl(
        tmp_path / "many.jsonl", [{**row, "choices": [str(i) for i in range(27)], "answer": 0}]
    )
    with pytest.raises(ValueError, match="27 choices, more than the 26 letters"):
        vqa.load(source=many)
    precision = _write_jsonl(tmp_path / "precision.jsonl", [{**row, "precision": 1.5}])
    with pytest.raises(ValueError, match="whole number of decimal places, got 1.5"):
        vqa.load(source=precision)
    blank = _write_jsonl(tmp_path / "blank.jsonl", [{**row, "answer": " "}])
    with pytest.raises(ValueError, match="non-empty string or a number"):
        vqa.load(source=blank)
    scienceqa = tmp_path / "sqa.json"
    scienceqa.write_text(json.dumps([{"question": "q", "choices": ["x", "y"], "answer": 5, "image": None}]))
    with pytest.raises(
        ValueError, match=r"sqa.json: row 0: ScienceQA 'answer' must be an option index 0..1, got 5"
    ):
        vqa.load(source=str(scienceqa))
    free_form = tmp_path / "mathvista.json"
    free_form.write_text(json.dumps({"8": {"pid": "8", "question": "q", "choices": None, "answer": "2",
                                           "question_type": "free_form", "image": "x.png"}}))  # fmt: skip
    with pytest.raises(ValueError, match="no MathVista rows with question_type 'multi_choice'"):
        vqa.load(source=str(free_form))


# ---------------------------------------------------------------------------------------------- easy-vqa


@pytest.fixture(scope="module")
def easy_vqa_splits():
    return {split: vqa.load(split) for split in ("train", "test")}


def test_easy_vqa_loads_offline_with_the_documented_counts(easy_vqa_splits):
    import easy_vqa

    train, test = easy_vqa_splits["train"], easy_vqa_splits["test"]
    assert len(train) == 38_575 and len(test) == 9_673
    answers = set(easy_vqa.get_answers())
    assert len(answers) == 13
    for split, samples in easy_vqa_splits.items():
        assert len({s.id for s in samples}) == len(samples)
        assert {s.answer for s in samples} == answers
        assert all(s.meta["kind"] == "short_answer" and len(s.images) == 1 for s in samples)
        paths = {s.images[0] for s in samples}
        assert len(paths) == (4_000 if split == "train" else 1_000)
        assert all(Path(p).is_absolute() and Path(p).is_file() for p in paths)
    first = train[0]
    assert first.question == "What is the blue shape?" and first.answer == "rectangle"
    assert Path(first.images[0]).parts[-3:] == ("train", "images", "0.png")
    assert sum(s.answer in ("yes", "no") for s in train) == 28_407  # the package README's yes/no count
    assert sum(s.answer in ("yes", "no") for s in test) == 7_136
    with Image.open(test[0].images[0]) as image:
        assert image.size == (64, 64)


def test_easy_vqa_load_opens_no_image(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load must not open images")

    monkeypatch.setattr(Image, "open", refuse)
    assert len(vqa.load("test")) == 9_673


def test_easy_vqa_ground_truth_scores_through_the_reward(easy_vqa_splits):
    sample = easy_vqa_splits["test"][0]
    _assert_parts(vqa.reward(_completion(_answer(sample.answer.upper() + ".")), sample), _expected(1, True))
    wrong = "no" if sample.answer != "no" else "yes"
    _assert_parts(vqa.reward(_completion(_answer(wrong)), sample), _expected(0, True))


def test_fixture_samples_encode_with_the_tiny_policy(tiny_policy):
    # every loader's samples reach the model: bytes-backed PIL images, path images, two images, none
    from vlm_grpo_ma.model.prompts import encode_prompt

    expected_sizes = {
        "p1": ((3, 2),), "p2": ((3, 2), (2, 3)), "p3": (), "scienceqa_0": ((3, 2),), "scienceqa_1": (),
        "1": ((3, 3),), "clevr_r1v_0": ((3, 2),), "11": (),
    }  # fmt: skip
    files = ("project.jsonl", "scienceqa.parquet", "mathvista.parquet", "clevr_r1v.parquet")
    samples = [s for name in files for s in vqa.load(source=str(FIXTURES / name))]
    samples += vqa.load("train", str(FIXTURES / "scienceqa_problems.json"))
    checked = [sample for sample in samples if sample.id in expected_sizes]
    assert sorted(sample.id for sample in checked) == sorted(expected_sizes)
    for sample in checked:
        encoded = encode_prompt(tiny_policy, sample, vqa.INSTRUCTION)
        assert encoded.original_sizes == expected_sizes[sample.id], sample.id
        assert len(encoded.input_sizes) == len(sample.images)
        text = tiny_policy.processor.decode(encoded.input_ids)
        assert sample.question.splitlines()[-1] in text and vqa.INSTRUCTION in text


@pytest.mark.parametrize(
    "text, sample, expected",
    [
        ("<think>t</think><answer> B. dog </answer>", _choice_sample(), {"answer": "B. dog", "options": ["B"]}),
        ("<think>t</think><answer>A, B</answer>", _choice_sample(), {"answer": "A, B", "options": []}),
        ("<think>t</think><answer>three</answer>", _short_sample(), {"answer": "three"}),
        ("<think>t</think><answer> </answer>", _short_sample(), None),
        ("no tags", _choice_sample(), None),
    ],
)
def test_prediction_for_evaluation_dumps(text, sample, expected):
    assert vqa.prediction(_completion(text), sample) == expected
