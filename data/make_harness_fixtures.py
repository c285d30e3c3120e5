"""Generate the small benchmark files in lmms-eval's formats that the harness bridge scores offline
(``python -m vlm_grpo_ma.evaluate --harness lmms-eval``, docs/EVALUATION.md).

``python data/make_harness_fixtures.py`` rewrites ``data/harness/refcoco_testA.parquet``: the first 16 scenes of
the embedded grounding test split (data/grounding) as rows of lmms-lab's RefCOCO parquet (the dataset lmms-eval's
``refcoco_*`` tasks read): ``question_id``, ``image`` (a Hugging Face Image cell, the PNG's bytes), ``question``
(lmms-lab's fixed captioning prompt), ``answer`` (the referring expressions: here the scene's one expression),
``bbox`` (COCO ``[x, y, w, h]`` in pixels; the scenes' boxes are pixel-edge ``[x1, y1, x2, y2]``), ``file_name``,
written by ``datasets`` with its features, as the hub's files are (lmms-eval's stock tasks get decoded images).
The same file is a ``data.source`` the grounding task reads, so the bridge's numbers can be checked sample by
sample against this project's evaluator.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "harness")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    refcoco_rows().to_parquet(str(args.out_dir / "refcoco_testA.parquet"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
