"""Generate the small benchmark files in lmms-eval's formats that the harness bridge scores offline
(``python -m vlm_grpo_ma.evaluate --harness lmms-eval``, docs/EVALUATION.md).

``python data/make_harness_fixtures.py`` rewrites two files.

``data/harness/refcoco_testA.parquet``: the first 16 scenes of
the embedded grounding test split (data/grounding) as rows of lmms-lab's RefCOCO parquet (the dataset lmms-eval's
``refcoco_*`` tasks read): ``question_id``, ``image`` (a Hugging Face Image cell, the PNG's bytes), ``question``
(lmms-lab's fixed captioning prompt), ``answer`` (the referring expressions: here the scene's one expression),
``bbox`` (COCO ``[x, y, w, h]`` in pixels; the scenes' boxes are pixel-edge ``[x1, y1, x2, y2]``), ``file_name``,
written by ``datasets`` with its features, as the hub's files are (lmms-eval's stock tasks get decoded images).
The same file is a ``data.source`` the grounding task reads, so the bridge's numbers can be checked sample by
sample against this project's evaluator.

``data/harness/mathvista_testmini.parquet``: the first 12 pictures of the embedded counting test split
(data/counting) as rows of MathVista's testmini (``AI4Math/MathVista``, the dataset lmms-eval's ``mathvista_*``
tasks read). Rows 0-7 are ``free_form`` integer questions, as the pictures ask them. Rows 8-11 are
``multi_choice``: the same question with three choices around the answer (answer - 1, answer, answer + 1, in
an order that varies with the row), the answer being the right choice's text, as MathVista's are. The math task
reads the free-form rows of the file and the vqa task the multiple-choice ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datasets import Dataset, Features, Image, Sequence, Value

ROOT = Path(__file__).resolve().parent
ROWS = 16
LMMS_QUESTION = "Please carefully observe the area circled in the image and come up with a caption for the area."


FEATURES = Features({
    "question_id": Value("string"), "image": Image(), "question": Value("string"), "answer": Sequence(Value("string")),
    "bbox": Sequence(Value("float64")), "file_name": Value("string"),
})  # fmt: skip


def refcoco_rows(rows: int = ROWS) -> Dataset:
    scenes = [json.loads(line) for line in (ROOT / "grounding" / "test.jsonl").read_text().splitlines()[:rows]]
    records = []
    for scene in scenes:
        x1, y1, x2, y2 = scene["box"]
        records.append({
            "question_id": scene["id"],
            "image": {"bytes": (ROOT / "grounding" / scene["image"]).read_bytes(), "path": Path(scene["image"]).name},
            "question": LMMS_QUESTION,
            "answer": [scene["expression"]],
            "bbox": [float(x1), float(y1), float(x2 - x1), float(y2 - y1)],
            "file_name": Path(scene["image"]).name,
        })  # fmt: skip
    return Dataset.from_list(records, features=FEATURES)


MATHVISTA_FEATURES = Features({
    "pid": Value("string"), "question": Value("string"), "image": Value("string"), "decoded_image": Image(),
    "choices": Sequence(Value("string")), "unit": Value("string"), "precision": Value("float64"),
    "answer": Value("string"), "question_type": Value("string"), "answer_type": Value("string"),
    "query": Value("string"),
})  # fmt: skip
MATHVISTA_ROWS, MATHVISTA_CHOICE_ROWS = 12, 4


def mathvista_rows() -> Dataset:
    pictures = [json.loads(line) for line in (ROOT / "counting" / "test.jsonl").read_text().splitlines()[:MATHVISTA_ROWS]]
    records = []
    for index, picture in enumerate(pictures):
        answer = int(picture["answer"])
        multi_choice = index >= MATHVISTA_ROWS - MATHVISTA_CHOICE_ROWS
        choices = [str(answer + offset) for offset in (-1, 0, 1)] if multi_choice else None
        if choices:
            shift = index % 3
            choices = choices[shift:] + choices[:shift]
        hint = ("Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, at the end."
                if multi_choice else "Hint: Please answer the question requiring an integer answer and provide the "
                "final value, e.g., 1, 2, 3, at the end.")  # fmt: skip
        options = "\nChoices:\n" + "\n".join(f"({chr(65 + i)}) {c}" for i, c in enumerate(choices)) if choices else ""
        records.append({
            "pid": str(index + 1), "question": picture["question"], "image": picture["images"][0],
            "decoded_image": {"bytes": (ROOT / "counting" / picture["images"][0]).read_bytes(), "path": Path(picture["images"][0]).name},
            "choices": choices, "unit": None, "precision": None, "answer": str(answer),
            "question_type": "multi_choice" if multi_choice else "free_form",
            "answer_type": "text" if multi_choice else "integer",
            "query": f"{hint}\nQuestion: {picture['question']}{options}",
        })  # fmt: skip
    return Dataset.from_list(records, features=MATHVISTA_FEATURES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "harness")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    refcoco_rows().to_parquet(str(args.out_dir / "refcoco_testA.parquet"))
    mathvista_rows().to_parquet(str(args.out_dir / "mathvista_testmini.parquet"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
