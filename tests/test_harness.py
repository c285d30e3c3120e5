"""The lmms-eval bridge (``python -m vlm_grpo_ma.evaluate --harness lmms-eval``; tools/harness.py and
tools/harness_worker.py): its task files and one-line refusals everywhere; where the harness is installed
(``scripts/setup.sh --harness``; ``.ci/run`` installs it), the same checkpoint scored by this project's evaluator
and through lmms-eval with the training prompt agreeing sample by sample, and each family's coordinate frame
scored by the harness against hand-computed IoU."""

import json
import subprocess
import textwrap

import pytest

from vlm_grpo_ma.tools import evaluate
from vlm_grpo_ma.tools.harness import HARNESS_PYTHON, ROOT, HarnessError, harness_python, task_files

FIXTURE = ROOT / "data" / "harness" / "refcoco_testA.parquet"
MATHVISTA = ROOT / "data" / "harness" / "mathvista_testmini.parquet"
COUNT_MODEL = ROOT / "vlm_grpo_ma" / "assets" / "tiny-qwen2.5-vl-count"


def _installed() -> bool:
    try:
        harness_python()
    except HarnessError:
        return False
    return True


needs_harness = pytest.mark.skipif(
    not _installed(), reason=f"lmms-eval is not installed ({HARNESS_PYTHON}: scripts/setup.sh --harness makes it; .ci/run does)"
)


def test_training_prompt_task_files_name_the_project_task_and_the_local_data(tmp_path):
    run = task_files(tmp_path, ["refcoco_bbox_rec_testA", "refcocog_bbox_rec_val"], {"refcocog_bbox_rec_val": str(FIXTURE)}, "training")
    assert run == ["vgm_refcoco_bbox_rec_testA", "vgm_refcocog_bbox_rec_val"]
    text = (tmp_path / "vgm_refcoco_bbox_rec_testA.yaml").read_text()
    assert f'testA: "{FIXTURE}"' in text and "vgm_tasks: [\"grounding\"]" in text and "test_split: testA" in text
    assert "vgm_tasks: [\"grounding\"]" in (tmp_path / "vgm_refcocog_bbox_rec_val.yaml").read_text()
    assert "harness_worker import" in (tmp_path / "utils.py").read_text()
    assert task_files(tmp_path / "stock", ["mathvista_testmini"], {}, "stock") == ["mathvista_testmini"]  # lmms-eval's own


@pytest.mark.parametrize(
    ("names", "sources", "message"),
    [
        (["vstar_bench"], {}, "no training-prompt task file for vstar_bench; .* --prompt stock"),
        (["refcoco_bbox_rec_val"], {}, r"needs a local copy .* --source refcoco_bbox_rec_val=FILE"),
        (["refcoco_bbox_rec_val"], {"refcoco_bbox_rec_val": "/nonexistent.parquet"}, "no such file"),
    ],
)
def test_what_the_bridge_cannot_run_is_one_line(tmp_path, names, sources, message):
    with pytest.raises(HarnessError, match=message):
        task_files(tmp_path, names, sources, "training")


def test_a_missing_harness_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_GRPO_MA_HARNESS_PYTHON", str(tmp_path / "no-python"))
    code = evaluate.main(["--harness", "lmms-eval", "--tasks", "refcoco_bbox_rec_testA", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "scripts/setup.sh --harness" in err and len(err.strip().splitlines()) == 1


@needs_harness
def test_the_harness_and_the_evaluator_agree_sample_by_sample(tmp_path, capsys):
    assert evaluate.main(["--harness", "lmms-eval", "--models", "tiny", "--tasks", "refcoco_bbox_rec_testA",
                          "--output-dir", str(tmp_path / "harness")]) == 0  # fmt: skip
    assert "lmms-eval 0.7.3, training prompt" in capsys.readouterr().out
    harnessed = json.loads((tmp_path / "harness" / "lmms-eval" / "tiny.json").read_text())["samples"]["vgm_refcoco_bbox_rec_testA"]
    assert evaluate.main(["--models", "tiny", "--tasks", "grounding", "--source", f"grounding={FIXTURE}", "--draw", "0",
                          "--no-progress", "--output-dir", str(tmp_path / "ours")]) == 0  # fmt: skip
    ours = [json.loads(line) for line in next((tmp_path / "ours").rglob("samples.jsonl")).read_text().splitlines()]
    assert len(harnessed) == len(ours) == 16
    for sample, record in zip(sorted(harnessed, key=lambda s: s["doc_id"]), ours, strict=True):
        assert json.loads(sample["response"]) == record["prediction"]  # the same answer, extracted the same way
        assert sample["iou"] == pytest.approx(record["parts"]["iou"], abs=1e-12)  # scored alike by the two codes
    assert sum(record["prediction"] is not None for record in ours) >= 12  # the answers carry boxes to compare


@needs_harness
def test_mathvista_through_the_harness_reads_each_row_as_its_project_task_does(tmp_path):
    """Free-form rows asked and parsed as the math task does, multiple-choice rows as the vqa task does: the same
    answers as this project's evaluator, row by row, on the counting warm start (whose answers are numbers)."""
    assert evaluate.main(["--harness", "lmms-eval", "--models", str(COUNT_MODEL), "--tasks", "mathvista_testmini",
                          "--output-dir", str(tmp_path / "harness")]) == 0  # fmt: skip
    written = json.loads(next((tmp_path / "harness" / "lmms-eval").glob("*.json")).read_text())
    harnessed = {s["doc_id"]: s for s in written["samples"]["vgm_mathvista_testmini"]}
    ours = {}
    for task in ("math", "vqa"):
        assert evaluate.main(["--models", str(COUNT_MODEL), "--tasks", task, "--source", f"{task}={MATHVISTA}", "--draw", "0",
                              "--no-progress", "--output-dir", str(tmp_path / task)]) == 0  # fmt: skip
        for line in next((tmp_path / task).rglob("samples.jsonl")).read_text().splitlines():
            record = json.loads(line)
            ours[int(record["id"]) - 1] = record  # pid 1.. is row 0..
    assert sorted(ours) == sorted(harnessed) == list(range(12))
    for row, record in ours.items():
        assert json.loads(harnessed[row]["response"]) == record["prediction"]
    # the harness's scorer (MathVista's) and the tasks' rewards agree on these plain integer answers
    assert [harnessed[row]["accuracy"] for row in range(12)] == [record["parts"]["accuracy"] for _, record in sorted(ours.items())]
    assert sum(record["prediction"] is not None for record in ours.values()) >= 5  # 6 of 12 here: answers to compare


FRAME_SCRIPT = textwrap.dedent("""
    import json, sys
    from vlm_grpo_ma.task_api.registry import Completion, Sample, get_task
    from vlm_grpo_ma.tools.harness_worker import harness_reply, refcoco_process_results
    scored = []
    for frame, written, input_size, original in json.loads(sys.argv[1]):
        sample = Sample("grounding", "0", "Locate: x.", (), None, {"width": original[0], "height": original[1]})
        completion = Completion("<think>t</think>", "<answer>" + json.dumps(written) + "</answer>", frame,
                                (tuple(input_size),), (tuple(original),))
        doc = {"bbox": [60, 40, 120, 80]}  # COCO x, y, w, h: [60, 40, 180, 120] in pixels
        scored.append(refcoco_process_results(doc, [harness_reply(get_task("grounding"), completion, sample)]))
    print(json.dumps(scored))
""")

# Each family writes the box [100, 60, 220, 140] in pixels of a 400 x 200 original, in its own frame
FAMILIES = {
    "qwen2_5_vl": ("absolute_input", [50, 30, 110, 70], [200, 100]),  # pixels of the 200 x 100 input it saw
    "qwen3_vl": ("relative_1000", [250, 300, 550, 700], [224, 112]),  # thousandths of each side
    "qwen3_5": ("relative_1000", [250, 300, 550, 700], [224, 112]),
}


@needs_harness
def test_the_harness_scores_each_family_s_frame_against_hand_computed_iou():
    from vlm_grpo_ma.model.loading import SUPPORTED_MODEL_TYPES

    assert {family: SUPPORTED_MODEL_TYPES[family].value for family in FAMILIES} == {f: v[0] for f, v in FAMILIES.items()}
    cases = [[frame, written, input_size, [400, 200]] for frame, written, input_size in FAMILIES.values()]
    done = subprocess.run([str(harness_python()), "-c", FRAME_SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          cwd=ROOT, check=True)  # fmt: skip
    # truth [60, 40, 180, 120]; intersection [100, 60, 180, 120] = 80 x 60 = 4800; union 9600 + 9600 - 4800 = 14400
    expected = {"iou": pytest.approx(4800 / 14400, abs=1e-12), "acc_iou50": 0.0}
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [expected] * len(FAMILIES)


@needs_harness
def test_the_stock_prompt_runs_lmms_eval_s_own_task_file_on_a_local_copy(tmp_path, capsys):
    assert evaluate.main(["--harness", "lmms-eval", "--prompt", "stock", "--models", "tiny", "--tasks", "refcoco_bbox_rec_testA",
                          "--source", f"refcoco_bbox_rec_testA={FIXTURE}", "--limit", "2", "--output-dir", str(tmp_path)]) == 0  # fmt: skip
    written = json.loads((tmp_path / "lmms-eval" / "tiny.json").read_text())
    assert written["ran"] == {"refcoco_bbox_rec_testA": "vgm_stock_refcoco_bbox_rec_testA"}
    samples = written["samples"]["vgm_stock_refcoco_bbox_rec_testA"]
    assert samples[0]["target"] == pytest.approx([105 / 168, 52 / 168, 148 / 168, 95 / 168])  # lmms-eval's own 0-1 boxes
    assert "<think>" in samples[0]["response"]  # the whole reply, for lmms-eval to extract from
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["prompt"] == "stock" and "refcoco_IoU" in results["results"]["tiny"]["refcoco_bbox_rec_testA"]


@needs_harness
def test_a_task_lmms_eval_does_not_know_is_one_line_naming_the_list(tmp_path, capsys):
    code = evaluate.main(["--harness", "lmms-eval", "--prompt", "stock", "--tasks", "no_such_bench", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "error: lmms-eval knows no task no_such_bench (.venv-harness/bin/python -m lmms_eval --tasks list lists them)"
    )
