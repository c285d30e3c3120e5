"""Rollout engines (rollout.engine): the choice and its errors, and the vLLM engine against the trainer.

The vLLM tests need `scripts/setup.sh --vllm`; without vLLM they are skipped, unless VLM_GRPO_MA_REQUIRE_VLLM=1
(.ci/run sets it), and then they fail. One engine is started for the module (~5 s on the CPU build).
"""

import os

import pytest
import torch
from PIL import Image

from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
from vlm_grpo_ma.engines.vllm import REQUIRE_ENV, merged_state_dict, unexpanded_ids, vllm_installed
from vlm_grpo_ma.model.loading import load_policy
from vlm_grpo_ma.model.logprobs import sequence_logprobs
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.run.config import ConfigError, load_config
from vlm_grpo_ma.run.rollout_engine import check_engine
from vlm_grpo_ma.task_api.registry import Sample

K, M = 2, 2


def _needs_vllm():
    if vllm_installed():
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but vLLM is not installed (scripts/setup.sh --vllm)")
    pytest.skip("vLLM is not installed (scripts/setup.sh --vllm)")


def test_engine_choice_is_validated():
    with pytest.raises(ConfigError, match=r"rollout.engine='sglang' is not valid; choose one of: hf, vllm"):
        load_config(None, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r"rollout.temperature=2.5: rollout.engine=vllm samples at temperatures up to 2"):
        load_config(None, ["rollout.engine=vllm", "rollout.temperature=2.5"])
    load_config(None, ["rollout.temperature=2.5"])  # the HF engine samples at any temperature
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.9: rollout.engine=vllm reports log-probs renormalised over the nucleus"):
        load_config(None, ["rollout.engine=vllm", "rollout.top_p=0.9"])
    load_config(None, ["rollout.top_p=0.9"])  # the HF engine reports the whole distribution's log-probs
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction='is' is not valid; choose one of: none, tis"):
        load_config(None, ["algorithm.rollout_correction=is"])
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction_cap=0.5 must be >= 1"):
        load_config(None, ["algorithm.rollout_correction=tis", "algorithm.rollout_correction_cap=0.5"])


def test_vllm_engine_refused_without_vllm_or_with_several_processes(monkeypatch):
    cfg = load_config(None, ["rollout.engine=vllm"])
    monkeypatch.setattr("vlm_grpo_ma.engines.vllm.vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"vLLM is not installed .* `scripts/setup.sh --vllm`"):
        check_engine(cfg, 1)
    monkeypatch.setattr("vlm_grpo_ma.engines.vllm.vllm_installed", lambda: True)
    with pytest.raises(ConfigError, match=r"one process only .* has 2 processes"):
        check_engine(cfg, 2)
    with pytest.raises(ConfigError, match=r"rollout.vllm_tensor_parallel_size=2: .* set it to 1"):
        check_engine(load_config(None, ["rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=2"]), 1)
    check_engine(load_config(None, []), 2)  # hf: any number of processes


def test_unexpanded_ids_collapse_each_image_run():
    assert unexpanded_ids([1, 9, 9, 9, 2, 9, 9, 3], 9) == [1, 9, 2, 9, 3]
    assert unexpanded_ids([1, 2], 9) == [1, 2]


def test_merged_state_dict_folds_lora_in(untrained_tiny_dir):
    """The pushed LoRA weights are what merging the adapter gives: the merged model's outputs."""
    from vlm_grpo_ma.model import lora

    policy = load_policy(str(untrained_tiny_dir))
    plain_keys = set(policy.model.state_dict())
    torch.manual_seed(0)
    policy.adapter = lora.apply_lora(policy.model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    for name, parameter in policy.model.named_parameters():
        if "lora_B" in name:  # B starts at 0: give the adapters an effect
            parameter.data.normal_(0, 0.5)
    state = {key: value.clone() for key, value in merged_state_dict(policy).items()}  # merging below is in place
    assert set(state) == plain_keys
    adapted = policy.adapter.merge_and_unload()
    for key, value in adapted.state_dict().items():
        assert torch.equal(state[key], value), key
    assert any(not torch.equal(state[k], v) for k, v in load_policy(str(untrained_tiny_dir)).model.state_dict().items())


# ----------------------------------------------------------------------------------------------------------
# vLLM engine


def _samples(n):
    colours = [(220, 30, 30), (30, 200, 40), (40, 40, 220)]
    return [Sample("grounding", str(i), "Locate: the circle" + " please" * i, (Image.new("RGB", (168, 112), colours[i]),), [0, 0, 1, 1]) for i in range(n)]


def _settings(seed):
    # stop text "e": untrained-model thoughts stop at uneven lengths; some hit the limit (forced close)
    return SamplingSettings(temperature=1.0, max_thought_tokens=12, max_answer_tokens=6, thought_stop="e",
                            generators=prompt_generators(seed, 0, 3))  # fmt: skip


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory, untrained_tiny_dir):
    _needs_vllm()
    from vlm_grpo_ma.engines.vllm import VLLMEngine

    policy = load_policy(str(untrained_tiny_dir))
    engine = VLLMEngine(str(untrained_tiny_dir), dtype="float32", seed=0)
    prompts = [encode_prompt(policy, s, "Think.") for s in _samples(3)]
    return policy, engine, _samples(3), prompts


def _tree(engine, policy, samples, prompts, seed):
    return engine.sample_tree(policy, samples, prompts, num_thoughts=K, num_answers=M, settings=_settings(seed))


@pytest.mark.vllm
def test_vllm_tree_is_the_trainers_distribution(vllm_setup):
    """The engine's tree has the K x M structure, and its log-probs are the trainer's (update.score_rows' path,
    fp32) of the same tokens: the gap the run logs as rollout/logprob_gap_max."""
    policy, engine, samples, prompts = vllm_setup
    tree = _tree(engine, policy, samples, prompts, seed=1)
    assert len(tree.thought_ids) == 3 * K and len(tree.answer_ids) == 3 * K * M
    close = policy.tokenizer.encode("e", add_special_tokens=False)
    for ids, forced, truncated in zip(tree.thought_ids, tree.thought_forced, tree.thought_truncated, strict=True):
        assert len(ids) <= 12 and ("e" in policy.tokenizer.decode(ids) or ids[-1] in policy.eos_token_ids)
        assert truncated == any(forced) and (not truncated or ids[-len(close):] == close)
    rows = range(len(tree.answer_ids))
    completions = [tree.thought_ids[a // M] + tree.answer_ids[a] for a in rows]
    with torch.no_grad():
        trainer = sequence_logprobs(policy, prompts, [a // (K * M) for a in rows], completions, temperature=1.0)
    worst = 0.0
    for a in rows:
        engine_logprobs = torch.tensor(tree.thought_logprobs[a // M] + tree.answer_logprobs[a])
        sampled = ~torch.tensor(tree.thought_forced[a // M] + [False] * len(tree.answer_ids[a]))
        worst = max(worst, float((trainer[a, : len(engine_logprobs)] - engine_logprobs).abs()[sampled].max()))
    assert worst < 1e-4
    hit_rate = engine.step_metrics()["rollout/prefix_cache_hit_rate"]
    assert hit_rate > 0.3  # stage 2 re-reads each prompt's blocks (0 with a block size the backend cannot share)


@pytest.mark.vllm
def test_sampling_after_a_push_equals_a_fresh_engine_with_those_weights(vllm_setup, tmp_path):
    """After push_weights the engine samples exactly what an engine started from the new weights samples (same
    seed): the weights arrived, and neither the encoder cache (image features of the old vision tower) nor the
    prefix cache (KV of the old weights) was reused."""
    from vlm_grpo_ma.engines.vllm import VLLMEngine

    policy, engine, samples, prompts = vllm_setup
    before = _tree(engine, policy, samples, prompts, seed=2)  # fills both caches with the old weights' entries
    with torch.no_grad():  # new weights, vision tower included
        generator = torch.Generator().manual_seed(0)
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    engine.push_weights(policy)
    pushed = _tree(engine, policy, samples, prompts, seed=2)
    policy.model.save_pretrained(tmp_path)
    policy.processor.save_pretrained(tmp_path)
    fresh_engine = VLLMEngine(str(tmp_path), dtype="float32", seed=0)
    fresh = _tree(fresh_engine, policy, samples, prompts, seed=2)
    assert before.answer_logprobs != fresh.answer_logprobs  # the new weights sample differently
    assert pushed.thought_ids == fresh.thought_ids and pushed.answer_ids == fresh.answer_ids
    for mine, theirs in zip(pushed.thought_logprobs + pushed.answer_logprobs, fresh.thought_logprobs + fresh.answer_logprobs, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)


@pytest.mark.vllm
def test_a_run_samples_with_vllm_and_pushes_every_update(tmp_path):
    """Two steps of the embedded model (whose rewards differ, so its weights move) with rollout.engine=vllm:
    every step's engine log-probs stay the trainer's (the weights of the previous update arrived) and the
    prefix cache is hit."""
    import json

    from conftest import tiny_run_config

    from vlm_grpo_ma.run import loop as train_module

    _needs_vllm()
    cfg = tiny_run_config("tiny", tmp_path / "run", "rollout.engine=vllm", "rollout.max_thought_tokens=40",
                          "rollout.max_answer_tokens=24", "train.prompts_per_step=4", "train.learning_rate=1e-2", steps=2)  # fmt: skip
    train_module.train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["train/grad_norm"] > 0  # the first update changed the weights that step 2 samples with
    for record in records:
        assert record["rollout/logprob_gap_max"] < 1e-4, record["step"]
        assert record["rollout/prefix_cache_hit_rate"] > 0.3, record["step"]
