"""Rollout engines (rollout.engine): the choice and its errors, and the vLLM engine against the trainer.

The vLLM tests need `scripts/setup.sh --vllm`; without vLLM they are skipped, unless VLM_GRPO_MA_REQUIRE_VLLM=1
(.ci/run sets it), and then they fail. One engine is started for the module (~5 s on the CPU build).
"""

import os

import pytest
import torch
from PIL import Image

from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
from vlm_grpo_ma.engines.vllm import REQUIRE_ENV, streamed_weights, vllm_installed
from vlm_grpo_ma.model.loading import load_policy
from vlm_grpo_ma.model.logprobs import sequence_logprobs
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.run.config import ConfigError
from vlm_grpo_ma.run.config_files import load_config
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
    # vLLM's CPU build reads its KV cache size with int(): a fraction would stop the engine at its start
    with pytest.raises(ConfigError, match=r"rollout.vllm_kv_cache_gib=0.25 must be a whole number of GiB"):
        load_config(None, ["rollout.engine=vllm", "rollout.vllm_kv_cache_gib=0.25"])
    load_config(None, ["rollout.engine=vllm", "rollout.vllm_kv_cache_gib=2"])


def test_vllm_engine_refused_without_vllm_or_with_a_tensor_parallel_size_off_the_launch(monkeypatch):
    cfg = load_config(None, ["rollout.engine=vllm"])
    monkeypatch.setattr("vlm_grpo_ma.engines.vllm.vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"vLLM is not installed .* `scripts/setup.sh --vllm`"):
        check_engine(cfg, 1)
    monkeypatch.setattr("vlm_grpo_ma.engines.vllm.vllm_installed", lambda: True)
    if vllm_installed():  # the import check imports the real one
        check_engine(cfg, 2)  # one engine per process
        check_engine(load_config(None, ["rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=2"]), 4)  # two engines of two
        tp2 = load_config(None, ["rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=2"])
        with pytest.raises(ConfigError, match=r"rollout.vllm_tensor_parallel_size=2: .* divide the launch's 3 process\(es\); valid: 1, 3$"):
            check_engine(tp2, 3)
        with pytest.raises(ConfigError, match=r"divide the launch's 1 process\(es\); valid: 1$"):
            check_engine(tp2, 1)
    check_engine(load_config(None, []), 2)  # hf: any number of processes


def test_a_vllm_that_does_not_import_is_refused_before_the_model_loads(tmp_path):
    """An installed vLLM built for another torch fails at import: the run stops at its start, exit 2, with the
    import's message and the command that reinstalls it (planted: the import check removed, the run loaded the
    model and then died with the ImportError's traceback)."""
    import subprocess
    import sys
    from pathlib import Path

    broken = tmp_path / "site" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("vllm/_C.abi3.so: undefined symbol: _ZN3c1017RegisterOperators")\n')
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(root)]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "vlm_grpo_ma.train", "--task", "grounding", "rollout.engine=vllm", "train.steps=1",
                           "--output-dir", str(tmp_path / "run")], cwd=root, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "vLLM is installed and does not import: ImportError: vllm/_C.abi3.so: undefined symbol" in done.stderr
    assert "scripts/setup.sh --vllm" in done.stderr and "Traceback" not in done.stderr
    assert "trainable:" not in done.stdout + done.stderr  # stopped before the model loaded


def test_streamed_weights_are_the_merged_model_one_tensor_at_a_time_in_the_engines_dtype(untrained_tiny_dir):
    """The pushed LoRA weights are what merging the adapter gives (the merged model's weights), streamed (a
    generator: one merged tensor at a time, never a merged copy of the whole model) and cast to the engine's
    dtype. Planted: the LoRA scale left out of the merge, or fan_in_fan_out ignored, fails the equality."""
    import inspect

    from vlm_grpo_ma.model import lora

    policy = load_policy(str(untrained_tiny_dir))
    plain_keys = set(policy.model.state_dict())
    torch.manual_seed(0)
    policy.adapter = lora.apply_lora(policy.model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    for name, parameter in policy.model.named_parameters():
        if "lora_B" in name:  # B starts at 0: give the adapters an effect
            parameter.data.normal_(0, 0.5)
    stream = streamed_weights(policy, torch.float32)
    assert inspect.isgenerator(stream)
    state = {key: value.clone() for key, value in stream}  # merging below is in place
    assert set(state) == plain_keys
    assert {value.dtype for _, value in streamed_weights(policy, torch.bfloat16)} == {torch.bfloat16}
    adapted = policy.adapter.merge_and_unload()
    for key, value in adapted.state_dict().items():
        assert torch.allclose(state[key], value, rtol=0, atol=1e-6), key
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
def test_a_run_whose_prompts_hold_two_images_samples_them_with_vllm(tmp_path):
    """The engine reserves room for the most images a training prompt holds (VQA fixtures: two, one and none).
    Planted: the engine started for one image, as it was; the first two-image prompt then raised a ValueError
    at sampling, after the engine had started. The engine's log-probs of every prompt are the trainer's."""
    import json
    from pathlib import Path

    from conftest import tiny_run_config

    from vlm_grpo_ma.run import loop as train_module

    _needs_vllm()
    source = Path(__file__).resolve().parent / "fixtures" / "vqa" / "project.jsonl"
    cfg = tiny_run_config("tiny", tmp_path / "run", "data.task=vqa", f"data.source={source}", "rollout.engine=vllm",
                          "train.prompts_per_step=3", "train.eval_every=0", steps=1)  # fmt: skip
    train_module.train(cfg)
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout/logprob_gap_max"] < 1e-4


# ----------------------------------------------------------------------------------------------------------
# vLLM engine on a hybrid model (Qwen3.5: Gated DeltaNet layers beside attention)

# vLLM's bf16 tree against the trainer's bf16 forward of the same tokens. It is bf16 rounding itself and grows with
# the weights: on this test's tree (the tiny Qwen3.5 + N(0, 0.05) noise, 8 seeds, 1,580 tokens) max 2.4e-2, mean
# 4.8e-3, where the bf16 trainer is as far from the fp32 forward of the same weights (max 2.4e-2, mean 3.9e-3); on the
# untouched random weights (docs/VLLM.md "Qwen3.5", 10,495 tokens) max 7.8e-3, mean 6.3e-4.
BF16_GAP_MAX, BF16_GAP_MEAN = 5e-2, 1e-2


@pytest.mark.vllm
def test_vllm_samples_a_qwen3_5_tree_with_the_trainers_logprobs(tmp_path):
    """On a tiny random Qwen3.5 (bf16: vLLM's CPU Gated DeltaNet kernel takes nothing else) the engine, given
    weights that differ from its folder's, samples the K x M tree with the trainer's log-probs within the bf16 gap,
    and its requests resume from cached states (prefix-cache hits at 32-token boundaries: with vLLM's default
    whole-block hits the tiny model's 1056-token blocks give none). A float32 engine is refused first.
    Planted: the push skipping the Gated DeltaNet weights, the answers asked without the thought's last token
    (both: the gap), ``prefix_match_unit`` left out (hit rate 0)."""
    _needs_vllm()
    from vlm_grpo_ma.engines.vllm import VLLMEngine
    from vlm_grpo_ma.model.tiny import build_tiny_qwen3_5
    from vlm_grpo_ma.tools.bench_engines import logprob_gaps

    folder = str(build_tiny_qwen3_5(tmp_path / "tiny-qwen3.5"))
    with pytest.raises(ValueError, match=r"Gated DeltaNet layers .* bfloat16 only .* set model.dtype=bfloat16"):
        VLLMEngine(folder, dtype="float32", seed=0)
    policy = load_policy(folder, dtype="bfloat16")
    policy.model.eval()
    with torch.no_grad():  # the engine must take these, every layer kind, from the push
        generator = torch.Generator().manual_seed(0)
        for parameter in policy.model.parameters():
            parameter.add_((torch.randn(parameter.shape, generator=generator) * 0.05).to(parameter.dtype))
    engine = VLLMEngine(folder, dtype="bfloat16", seed=0)
    engine.push_weights(policy)
    samples = _samples(3)
    prompts = [encode_prompt(policy, s, "Think.") for s in samples]
    engine.step_metrics()
    num_thoughts, num_answers = 2, 3
    tree = engine.sample_tree(policy, samples, prompts, num_thoughts=num_thoughts, num_answers=num_answers, settings=_settings(1))
    hit_rate = engine.step_metrics()["rollout/prefix_cache_hit_rate"]
    assert len(tree.thought_ids) == 3 * num_thoughts and len(tree.answer_ids) == 3 * num_thoughts * num_answers
    gaps = logprob_gaps(policy, prompts, tree, num_thoughts, num_answers)
    assert gaps.max() < BF16_GAP_MAX and gaps.mean() < BF16_GAP_MEAN, (float(gaps.max()), float(gaps.mean()))
    assert hit_rate > 0.3, hit_rate  # 0.57 measured (hits land on 32-token boundaries of ~60-token prompts); 0 with whole blocks


def test_a_qwen3_5_run_the_cpu_vllm_build_cannot_sample_is_refused_before_the_model_loads(tiny_qwen3_5_dir):
    """vLLM's CPU kernel for Gated DeltaNet layers takes bfloat16 only: a float32 Qwen3.5 run with the vLLM engine
    is a config error at start (naming model.dtype), a bf16 one passes; other models are not asked."""
    _needs_vllm()
    if torch.cuda.is_available():
        pytest.skip("the limit is the CPU build's")
    with pytest.raises(ConfigError, match=r"Gated DeltaNet .* set model\.dtype=bfloat16"):
        check_engine(load_config(None, [f"model.name_or_path={tiny_qwen3_5_dir}", "rollout.engine=vllm"]), 1)
    check_engine(load_config(None, [f"model.name_or_path={tiny_qwen3_5_dir}", "rollout.engine=vllm", "model.dtype=bfloat16"]), 1)
    check_engine(load_config(None, ["rollout.engine=vllm"]), 1)  # the embedded Qwen2.5-VL in float32
