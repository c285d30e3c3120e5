"""The zoom task trained and sampled end to end (issue 46): `python -m vlm_grpo_ma.train --task zoom` starts from
the task's own warm start, its thoughts call the zoom tool, the crops come back as turns, and the trainer's
log-probs are the sampler's; the vLLM engine samples the same kind of tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from vlm_grpo_ma.run import cli

ROOT = Path(__file__).resolve().parents[1]
ZOOM_MODEL = ROOT / "vlm_grpo_ma" / "assets" / "tiny-qwen2.5-vl-zoom"
SMALL = ["train.prompts_per_step=2", "rollout.num_thoughts=4", "rollout.num_answers=2", "rollout.max_thought_tokens=160",
         "rollout.max_answer_tokens=12", "train.eval_every=0", "train.micro_batch_rows=16"]  # fmt: skip


def test_train_task_zoom_runs_its_preset_and_its_rollouts_show_tool_turns(tmp_path, capsys):
    """`--task zoom` with no --config runs the task's preset (configs/tiny-zoom.yaml: the zoom warm start, room in
    the thought for a call and its turn), the command line's keys on top, said in one line. One step: its
    rollouts record tool turns with crop boxes, the step logs the tools/ figures, and the HF engine's log-probs
    are the trainer's (rollout/logprob_gap_max under 1e-4 in float32) with crops in the thoughts. Planted: the
    preset not applied (the default model and 40-token thoughts then wrote no call: looked_share 0)."""
    out = tmp_path / "run"
    small = ["train.prompts_per_step=2", "rollout.num_answers=2", "train.eval_every=0", "train.micro_batch_rows=16"]
    assert cli.main(["--task", "zoom", "train.steps=1", f"train.output_dir={out}", *small]) == 0
    assert "runs with its preset" in capsys.readouterr().err
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert Path(saved["model"]["name_or_path"]).name == ZOOM_MODEL.name and saved["rollout"]["max_thought_tokens"] == 160
    assert saved["train"]["prompts_per_step"] == 2  # the command line over the preset
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["tools/looked_share"] > 0 and metrics["tools/calls_per_thought"] >= metrics["tools/looked_share"]
    assert metrics["tools/result_tokens_per_thought"] > 0
    assert metrics["rollout/logprob_gap_max"] < 1e-4
    tree = json.loads((out / "rollouts.jsonl").read_text().splitlines()[0])
    turns = [turn for thought in tree["thoughts"] for turn in thought.get("tool_turns", [])]
    assert any(turn["images"] == 1 and len(turn["crop_boxes"]) == 1 for turn in turns)
    assert any("image_zoom_in_tool" in thought["thought"] for thought in tree["thoughts"])


def test_a_mixture_or_a_task_without_a_preset_keeps_the_command_line_config():
    """Only a one-task run gets its task's preset. Planted: the preset applied to any run with zoom among its
    tasks: the mixture got it."""
    from vlm_grpo_ma.run.cli import with_task_preset
    from vlm_grpo_ma.run.config_files import load_config

    mixture = load_config(None, ["data.tasks={zoom: 1, grounding: 1}"])
    assert with_task_preset(mixture, [], 0) is mixture
    grounding = load_config(None, ["data.task=grounding"])
    assert with_task_preset(grounding, [], 0) is grounding
    alone = with_task_preset(load_config(None, ["data.task=zoom"]), ["data.task=zoom", "model.name_or_path=tiny"], 1)
    assert alone.model.name_or_path == "tiny" and alone.rollout.max_thought_tokens == 160


@pytest.mark.vllm
def test_vllm_samples_tool_turns_with_the_trainers_logprobs():
    """The vLLM engine continues each thought after its served call, the crop added to the request's images: the
    trees hold turns with crops, vLLM's expansion of each continuation equals the trainer's ids (the engine
    checks), its log-probs on the model's own tokens are the trainer's in float32, and the prefix cache serves
    the continuations and the answers. A thought that ended is not served again. Planted: the crops left out of
    the continuation's images (vLLM then refused the request's placeholder); a finished thought left waiting
    (the bug the first version had: it was served again and closed twice, "red</think></think>")."""
    from test_engines import _needs_vllm

    _needs_vllm()
    from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
    from vlm_grpo_ma.engines.vllm import VLLMEngine
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.model.logprobs import shared_prefix_logprobs
    from vlm_grpo_ma.model.prompts import encode_prompt
    from vlm_grpo_ma.task_api.registry import get_task, load_samples

    task = get_task("zoom")
    samples = load_samples(task, "test")[:3]
    policy = load_policy(str(ZOOM_MODEL))
    prompts = [encode_prompt(policy, s, task.instruction) for s in samples]
    engine = VLLMEngine(str(ZOOM_MODEL), dtype="float32", seed=0, max_images=3)
    K, M = 4, 2
    settings = SamplingSettings(max_thought_tokens=160, max_answer_tokens=12, max_turns=2, generators=prompt_generators(5, 0, 3))
    try:
        tree = engine.sample_tree(policy, samples, prompts, num_thoughts=K, num_answers=M, settings=settings)
        hit_rate = engine.step_metrics()["rollout/prefix_cache_hit_rate"]
    finally:
        engine.close(True)
    assert sum(turn.num_images for turns in tree.thought_turns for turn in turns) >= 2
    for ids, turns in zip(tree.thought_ids, tree.thought_turns, strict=True):  # a finished thought is not continued
        text = policy.tokenizer.decode(ids)
        assert text.count("</think>") == 1 and text.endswith("</think>")
        assert len(turns) == text.count("</tool_call>") - int(text.endswith("</tool_call></think>"))
    rows = range(len(tree.answer_ids))
    completions = [tree.thought_ids[a // M] + tree.answer_ids[a] for a in rows]
    with torch.no_grad():
        trainer = shared_prefix_logprobs(policy, prompts, [a // (K * M) for a in rows], completions,
                                         [len(tree.thought_ids[a // M]) for a in rows], temperature=1.0,
                                         thought_turns=[tree.thought_turns[a // M] for a in rows])  # fmt: skip
    for a in rows:
        engine_logprobs = torch.tensor(tree.thought_logprobs[a // M] + tree.answer_logprobs[a])
        own = ~torch.tensor(tree.thought_forced[a // M] + [False] * len(tree.answer_ids[a]))
        assert float((trainer[a, : len(engine_logprobs)] - engine_logprobs).abs()[own].max()) < 1e-4
    assert hit_rate > 0.3
