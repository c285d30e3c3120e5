"""Evaluation: pass@k, metric summaries, model resolution, resuming, and the CLI end to end."""

import json
from itertools import combinations

import pytest

from vlm_grpo_ma.run import evaluation
from vlm_grpo_ma.run import loop as train_module
from vlm_grpo_ma.run.config_files import load_config
from vlm_grpo_ma.task_api.coords import CoordinateFrame
from vlm_grpo_ma.task_api.registry import Completion, Sample, Task, get_task
from vlm_grpo_ma.tools import evaluate


@pytest.mark.parametrize(
    "n, c, k, expected",
    [(5, 2, 1, 0.4), (5, 2, 2, 0.7), (5, 0, 3, 0.0), (5, 5, 1, 1.0), (4, 1, 4, 1.0), (10, 3, 5, 1 - 21 / 252)],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_answer():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (3, 4, 1), (3, 1, 0)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=f"n={n} c={c} k={k}"):
        evaluation.pass_at_k(n, c, k)


def test_reported_k_values():
    assert evaluation.pass_at_k_values(1) == [1]
    assert evaluation.pass_at_k_values(4) == [1, 2, 4]
    assert evaluation.pass_at_k_values(10) == [1, 2, 4, 8, 10]


def _record(sample_id, index, correct, iou=0.0, fmt=1.0, error=None, thought_tokens=4, answer_tokens=2):
    parts = {"acc_iou50": correct, "iou": iou, "format": fmt, "reward": iou + 0.5 * fmt}
    return {"id": sample_id, "sample_index": index, "parts": parts, "thought_tokens": thought_tokens,
            "answer_tokens": answer_tokens, "error": error}


def test_summary_of_records_hand_computed():
    task = get_task("grounding")
    records = [
        _record("a", 0, 1.0, iou=0.8), _record("a", 1, 0.0, iou=0.2), _record("a", 2, 0.0, iou=0.1, fmt=0.0),
        _record("b", 0, 0.0, iou=0.0, thought_tokens=10), _record("b", 1, 0.0, error="reward"),
        _record("b", 2, 1.0, iou=0.6, answer_tokens=8),
    ]
    records[4]["parts"] = {"reward": 0.0}  # a raising reward: no parts; counts as 0 everywhere
    m = evaluation.summarize_records(task, records, samples_per_prompt=3)
    assert m["prompts"] == 2 and m["answers"] == 6
    assert m["iou"] == pytest.approx((0.8 + 0.2 + 0.1 + 0.0 + 0.6) / 6)
    assert m["format"] == pytest.approx(4 / 6)
    assert m["accuracy"] == pytest.approx((1 / 3 + 1 / 3) / 2)
    assert m["pass@1"] == pytest.approx(1 / 3)
    assert m["pass@2"] == pytest.approx(1 - 1 / 3)  # per prompt: 1 - C(2,2)/C(3,2)
    assert m["pass@3"] == pytest.approx(1.0)
    assert m["thought_tokens"] == pytest.approx((4 * 5 + 10) / 6)
    assert m["answer_tokens"] == pytest.approx((2 * 5 + 8) / 6)
    assert m["errors"] == pytest.approx(1 / 6)


def test_greedy_summary_has_accuracy_but_no_pass_at_k():
    m = evaluation.summarize_records(get_task("grounding"), [_record("a", 0, 1.0), _record("b", 0, 0.0)], 1)
    assert m["accuracy"] == 0.5 and not any(k.startswith("pass@") for k in m)


@pytest.mark.parametrize("iou_box, expected_acc", [([0, 0, 50, 100], 1.0), ([0, 0, 49, 100], 0.0)])
def test_acc_iou50_threshold_is_inclusive(iou_box, expected_acc):
    """IoU of [0,0,50,100] with [0,0,100,100] is exactly 0.5 -> counted correct; 0.49 is not."""
    task = get_task("grounding")
    sample = task.load("test")[0]
    sample = type(sample)(sample.task, sample.id, sample.question, sample.images, [0.0, 0.0, 100.0, 100.0],
                          {"width": 200, "height": 200})
    c = Completion("<think>x</think>", f"<answer>{iou_box}</answer>", input_sizes=((200, 200),), original_sizes=((200, 200),))
    assert task.reward(c, sample)["acc_iou50"] == expected_acc


@pytest.mark.parametrize(
    "frame, written, input_size",
    [(CoordinateFrame.ABSOLUTE_INPUT, [28, 14, 56, 42], (112, 56)), (CoordinateFrame.RELATIVE_1000, [250, 250, 500, 750], (112, 56))],
)
def test_prediction_is_in_original_pixels_for_each_frame(frame, written, input_size):
    """A 400x200 original seen at 112x56: both frames' boxes map to [100, 50, 200, 150] original pixels."""
    task = get_task("grounding")
    sample = task.load("test")[0]
    sample = type(sample)(sample.task, sample.id, sample.question, sample.images, [100.0, 50.0, 200.0, 150.0],
                          {"width": 400, "height": 200})
    c = Completion("<think>x</think>", f"<answer>{written}</answer>", frame=frame, input_sizes=(input_size,),
                   original_sizes=((400, 200),))
    assert task.parse(c, sample) == {"box": pytest.approx([100.0, 50.0, 200.0, 150.0])}
    assert task.reward(c, sample)["iou"] == pytest.approx(1.0)


def test_resolve_model_kinds(tmp_path, monkeypatch):
    import huggingface_hub

    # the hub id below counts as in the local Hugging Face cache (an uncached one, offline, is refused at once)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo_id, filename: f"/cache/{repo_id}/{filename}")
    assert evaluate.resolve_model("tiny") == evaluate.ModelSpec("tiny", "tiny")
    run = tmp_path / "myrun"
    for step in (10, 20):
        folder = run / "checkpoints" / f"step-{step:06d}"
        (folder / "model").mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"")
    assert evaluate.resolve_model(str(run)) == evaluate.ModelSpec("myrun@step-000020", str(run / "checkpoints/step-000020/model"))
    assert evaluate.resolve_model(str(run), step=10).label == "myrun@step-000010"
    assert evaluate.resolve_model(str(run / "checkpoints/step-000010")).label == "myrun@step-000010"
    # a checkpoint's model/ folder is its run's model (and video budget), not a folder named "model"
    model = run / "checkpoints/step-000010/model"
    assert evaluate.resolve_model(str(model)) == evaluate.ModelSpec("myrun@step-000010", str(model))
    with pytest.raises(FileNotFoundError, match="no checkpoint for --step 30; it has: step-000010, step-000020"):
        evaluate.resolve_model(str(run), step=30)
    assert evaluate.resolve_model("Qwen/Qwen2.5-VL-3B-Instruct") == evaluate.ModelSpec("Qwen__Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct")


def test_results_table_has_a_column_per_model_and_the_change():
    table = evaluate.results_table({"tiny": {"g-test": {"iou": 0.25, "prompts": 3}}, "run@step-1": {"g-test": {"iou": 0.5, "prompts": 3}}})
    lines = table.splitlines()
    assert lines[0] == "| benchmark | metric | tiny | run@step-1 | change |"
    assert "| g-test | iou | 0.250 | 0.500 | +0.250 |" in lines
    assert "| g-test | prompts | 3 | 3 | +0 |" in lines


def test_interrupted_evaluation_resumes_without_redoing_finished_samples(tiny_policy, tmp_path):
    task = get_task("grounding")
    samples = task.load("test")[:5]
    settings = evaluation.EvalSettings(max_thought_tokens=6, max_answer_tokens=6)
    straight, straight_records = evaluation.evaluate_task(tiny_policy, task, samples, settings, batch_size=2, progress=False)
    path = tmp_path / "samples.jsonl"
    head = straight_records[:2]
    head[0] = {**head[0], "thought": "MARKER"}  # proves that the finished sample is read back, not regenerated
    path.write_text("".join(json.dumps(r) + "\n" for r in head) + '{"id": "test_000')  # a torn last line
    resumed, records = evaluation.evaluate_task(tiny_policy, task, samples, settings, batch_size=2, records_path=path, progress=False)
    assert [r["id"] for r in records] == [s.id for s in samples]
    assert records[0]["thought"] == "MARKER"
    assert [r["answer"] for r in records[1:]] == [r["answer"] for r in straight_records[1:]]
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [s.id for s in samples]
    assert resumed == straight


def test_sampling_gives_n_answers_per_prompt_and_pass_at_k(tiny_policy):
    task = get_task("grounding")
    settings = evaluation.EvalSettings(samples=3, temperature=1.0, max_thought_tokens=6, max_answer_tokens=6)
    metrics, records = evaluation.evaluate_task(tiny_policy, task, task.load("test")[:2], settings, progress=False)
    assert sorted((r["id"], r["sample_index"]) for r in records) == [(i, k) for i in ("test_00000", "test_00001") for k in range(3)]
    assert {k: metrics[k] for k in ("pass@1", "pass@2", "pass@3")} == pytest.approx(_brute_force_pass_at_k(task, records, 3))


def _brute_force_pass_at_k(task, records, n: int) -> dict[str, float]:
    """pass@k from the records themselves: per prompt, the share of its k-subsets of answers holding a correct
    one, averaged over prompts."""
    by_prompt = {}
    for r in records:
        by_prompt.setdefault(r["id"], []).append(r["parts"].get(task.success, 0.0) >= 1.0)
    result = {}
    for k in evaluation.pass_at_k_values(n):
        shares = [sum(any(s) for s in combinations(v, k)) / len(list(combinations(v, k))) for v in by_prompt.values()]
        result[f"pass@{k}"] = sum(shares) / len(shares)
    return result


def test_summary_pass_at_k_equals_a_brute_force_count_over_answer_subsets():
    task = get_task("grounding")
    correct = {"a": [1, 0, 0, 1], "b": [0, 0, 0, 0], "c": [0, 1, 0, 0], "d": [1, 1, 1, 1]}
    records = [_record(pid, i, float(c)) for pid, flags in correct.items() for i, c in enumerate(flags)]
    metrics = evaluation.summarize_records(task, records, samples_per_prompt=4)
    expected = _brute_force_pass_at_k(task, records, 4)
    assert set(expected) == {"pass@1", "pass@2", "pass@4"}
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, abs=1e-12)
    assert expected["pass@1"] == pytest.approx((0.5 + 0 + 0.25 + 1) / 4)  # and by hand


def test_broken_image_scores_zero_and_is_counted(tiny_policy, tmp_path):
    task = get_task("grounding")
    good = task.load("test")[0]
    broken = type(good)(good.task, "broken", good.question, (str(tmp_path / "missing.png"),), good.answer, good.meta)
    metrics, records = evaluation.evaluate_task(tiny_policy, task, [broken, good], evaluation.EvalSettings(max_thought_tokens=4, max_answer_tokens=4), progress=False)
    assert records[0]["error"] == "image" and records[0]["parts"]["reward"] == 0.0
    assert metrics["errors"] == 0.5 and metrics["prompts"] == 2


def test_raising_reward_scores_zero():
    def bad_reward(completion, sample):
        raise RuntimeError("boom")

    task = Task("bad", load=lambda *a: [], reward=bad_reward, instruction="")
    [(parts, prediction, error)] = evaluation._score_all(task, [Completion("", "")], [Sample("bad", "1", "q", (), None)], judge=None)
    assert parts == {"reward": 0.0} and error == "reward" and prediction is None


def test_cli_compares_the_embedded_model_and_a_trained_checkpoint(untrained_tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = load_config(None, [f"model.name_or_path={untrained_tiny_dir}", f"train.output_dir={run}", "train.steps=1",
                             "train.prompts_per_step=2", "rollout.num_thoughts=2", "rollout.num_answers=2",
                             "rollout.max_thought_tokens=6", "rollout.max_answer_tokens=6",
                             "logging.progress_bar=false", "logging.report_to=[]", "train.eval_every=0"])
    train_module.train(cfg)
    out = tmp_path / "eval"
    args = ["--models", "tiny", str(run), "--limit", "3", "--max-thought-tokens", "8", "--max-answer-tokens", "8",
            "--draw", "2", "--output-dir", str(out), "--no-progress"]
    assert evaluate.main(args) == 0
    printed = capsys.readouterr().out
    assert "| benchmark | metric | tiny | run@step-000001 | change |" in printed
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"tiny", "run@step-000001"}
    for label in results:
        assert results[label]["grounding-test"]["prompts"] == 3
        assert len(list((out / label / "grounding-test" / "draw").glob("*.png"))) == 2
        assert len((out / label / "grounding-test" / "samples.jsonl").read_text().splitlines()) == 3
    # the same command again resumes: nothing left to do, same results
    assert evaluate.main(args) == 0
    assert json.loads((out / "results.json").read_text())["results"] == results
    # other settings in the same folder are refused, naming the folder
    assert evaluate.main([*args, "--seed", "1"]) == 2
    assert "holds an evaluation with other settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "nope"], "unknown task 'nope'"),
        (["--source", "grounding"], "must look like TASK=FILE"),
        (["--source", "vqa=x.jsonl"], "not in --tasks grounding"),
        (["--source", "grounding=/nowhere/refcoco.parquet"], "grounding source file not found"),
        (["--models", "/nowhere/model"], "no such local folder"),
        (["--samples", "0"], "samples=0 must be >= 1"),
        (["--limit", "0"], "--limit=0 must be >= 1"),
    ],
)
def test_cli_errors_name_the_bad_value(args, message, tmp_path, capsys):
    assert evaluate.main([*args, "--output-dir", str(tmp_path / "e"), "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_a_resumed_sampled_evaluation_samples_what_a_straight_one_samples(tiny_policy, tmp_path):
    task = get_task("grounding")
    samples = task.load("test")[:4]
    settings = evaluation.EvalSettings(samples=2, temperature=1.0, max_thought_tokens=6, max_answer_tokens=6)
    _, straight = evaluation.evaluate_task(tiny_policy, task, samples, settings, batch_size=3, progress=False)
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in straight[:4]))  # the first two samples done
    _, resumed = evaluation.evaluate_task(tiny_policy, task, samples, settings, batch_size=3, records_path=path, progress=False)
    assert [(r["id"], r["sample_index"], r["thought"], r["answer"]) for r in resumed] == [
        (r["id"], r["sample_index"], r["thought"], r["answer"]) for r in straight
    ]


def test_drawings_carry_a_legend_of_prediction_and_truth(tmp_path):
    """The held-out drawings said nowhere which box was which. Planted: the legend left out; the image kept its
    drawn size and had neither swatch below it."""
    from vlm_grpo_ma.task_api.drawing import PREDICTION_COLOUR, TRUTH_COLOUR

    task = get_task("grounding")
    sample = task.load("test")[0]
    record = {"id": sample.id, "sample_index": 0, "prediction": {"box": [10.0, 10.0, 40.0, 40.0]}}
    assert evaluation.draw_predictions(task, [sample], [record], tmp_path, 1) == 1
    (png,) = tmp_path.glob("*.png")
    from PIL import Image

    drawn = task.draw(evaluation.open_image(sample.images[0]), sample, record["prediction"])
    image = Image.open(png).convert("RGB")
    assert image.width == drawn.width and image.height > drawn.height
    strip = {image.getpixel((x, y)) for x in range(image.width) for y in range(drawn.height, image.height)}
    assert PREDICTION_COLOUR in strip and TRUTH_COLOUR in strip


def test_a_task_without_draw_is_said_once_and_draws_nothing(tmp_path, caplog):
    """A task without ``draw`` got no drawings and no word why. Planted: the log line left out; this failed."""
    import dataclasses
    import logging

    task = dataclasses.replace(get_task("grounding"), name="grounding-without-draw", draw=None)
    sample = task.load("test")[0]
    record = {"id": sample.id, "sample_index": 0, "prediction": {"box": [10.0, 10.0, 40.0, 40.0]}}
    with caplog.at_level(logging.INFO, logger="vlm_grpo_ma.evaluate"):
        for _ in range(2):
            assert evaluation.draw_predictions(task, [sample], [record], tmp_path, 1) == 0
    said = [r.getMessage() for r in caplog.records if "has no draw function" in r.getMessage()]
    assert said == ["task grounding-without-draw has no draw function: no drawings of its predictions (docs/TASKS.md, Task.draw)"]
    assert list(tmp_path.iterdir()) == []
