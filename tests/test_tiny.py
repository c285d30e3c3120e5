"""The embedded default model: committed, loadable offline, the real Qwen2.5-VL classes, reproducible tokenizer."""

import json

from vlm_grpo_ma.model.loading import count_parameters, load_policy
from vlm_grpo_ma.model.tiny import TINY_MODEL_DIR, build_tokenizer
from vlm_grpo_ma.task_api.coords import CoordinateFrame


def test_embedded_model_loads_as_real_qwen2_5_vl():
    policy = load_policy("tiny")
    assert type(policy.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(policy.processor).__name__ == "Qwen2_5_VLProcessor"
    assert policy.frame is CoordinateFrame.ABSOLUTE_INPUT
    assert 0.5e6 < count_parameters(policy.model) < 5e6
    assert (TINY_MODEL_DIR / "model.safetensors").stat().st_size < 20e6


def test_committed_tokenizer_is_the_one_the_project_builds():
    committed = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text())
    rebuilt = json.loads(build_tokenizer().backend_tokenizer.to_str())
    assert committed["model"]["vocab"] == rebuilt["model"]["vocab"]
    assert committed["model"]["merges"] == rebuilt["model"]["merges"]


def test_format_tags_are_single_tokens_and_digits_are_split():
    tokenizer = load_policy("tiny").tokenizer
    assert tokenizer.tokenize("<think>a</think><answer>[12,104]</answer>") == [
        "<think>", "a", "</think>", "<answer>", "[", "1", "2", ",", "1", "0", "4", "]", "</answer>",
    ]


def test_the_embedded_model_localises_the_referred_object():
    """The shipped warm start looks at the image: on held-out scenes its greedy boxes beat one fixed box in
    the image centre (what a model that ignores the image can best do), and other images move its boxes."""
    import dataclasses

    from vlm_grpo_ma.run.evaluation import EvalSettings, evaluate_task
    from vlm_grpo_ma.task_api import iou
    from vlm_grpo_ma.task_api.registry import get_task

    policy = load_policy("tiny")
    task = get_task("grounding")
    samples = task.load("test")[:60]
    metrics, records = evaluate_task(policy, task, samples, EvalSettings(), progress=False)
    centre_box = [39, 39, 129, 129]  # 90 px, centred in the 168 px scenes
    centre_iou = sum(iou(centre_box, s.answer) for s in samples) / len(samples)
    assert metrics["format"] == 1.0
    assert metrics["iou"] > 1.5 * centre_iou

    shifted = [dataclasses.replace(s, images=samples[(i + 1) % len(samples)].images) for i, s in enumerate(samples)]
    _, shifted_records = evaluate_task(policy, task, shifted, EvalSettings(), progress=False)
    moved = sum(a["answer"] != b["answer"] for a, b in zip(records, shifted_records, strict=True))
    assert moved > 0.8 * len(samples)
