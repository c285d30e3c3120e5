"""Presets: accelerate launch configs (read by accelerate's own loader and launcher), the scale-out training
presets, and the model builder of scripts/gpu_check.py (3B size counted on the meta device, tiny built and
loaded for real)."""

import importlib.util
import json
import os
import re
from pathlib import Path
from unittest import mock

import pytest
import torch

from vlm_grpo_ma.run.config_files import load_config

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_DIR = ROOT / "configs" / "accelerate"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------------
# accelerate configs

# file -> (distributed_type, num_processes, mixed_precision, use_cpu)
ACCELERATE_EXPECTED = {
    "ddp.yaml": ("MULTI_GPU", 8, "bf16", False),
    "fsdp.yaml": ("FSDP", 8, "bf16", False),
    # MULTI_GPU on purpose: accelerate's launcher starts 2 workers only for multi-process types (see the file)
    "cpu-2proc.yaml": ("MULTI_GPU", 2, "no", True),
    "cpu-2proc-fsdp.yaml": ("FSDP", 2, "no", True),
}


def test_accelerate_presets_are_the_expected_files():
    assert sorted(p.name for p in ACCELERATE_DIR.glob("*.yaml")) == sorted(ACCELERATE_EXPECTED)


@pytest.mark.parametrize("name", sorted(ACCELERATE_EXPECTED))
def test_accelerate_preset_loads_with_accelerates_loader(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    path = ACCELERATE_DIR / name
    config = load_config_from_file(
        str(path)
    )  # what `accelerate launch --config_file` calls; rejects unknown keys
    assert isinstance(config, ClusterConfig)
    distributed_type, num_processes, mixed_precision, use_cpu = ACCELERATE_EXPECTED[name]
    assert config.distributed_type.value == distributed_type
    assert (config.num_processes, config.mixed_precision, config.use_cpu) == (
        num_processes,
        mixed_precision,
        use_cpu,
    )
    assert (config.num_machines, config.machine_rank) == (1, 0)
    text = path.read_text()
    for flag in ("--num_machines", "--machine_rank", "--main_process_ip"):
        assert flag in text, f"{name} should say how to override {flag} for several machines"


def _launch_args(name):
    """The launcher's view of a config file: what `accelerate launch --config_file FILE x.py` would use."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(ACCELERATE_DIR / name), "x.py"])
    args, _, _ = _validate_launch_command(args)
    return args


def test_fsdp_preset_wraps_qwen_layers_full_shard_bf16():
    from accelerate.utils import FullyShardedDataParallelPlugin, prepare_multi_gpu_env

    args = _launch_args("fsdp.yaml")
    assert args.use_fsdp and args.mixed_precision == "bf16"
    with mock.patch.dict(os.environ, prepare_multi_gpu_env(args)):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # FSDP2's full shard
    assert not plugin.transformer_cls_names_to_wrap  # the model's own _no_split_modules, whatever the family
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"
    assert plugin.cpu_ram_efficient_loading is False


@pytest.mark.parametrize("name", sorted(ACCELERATE_EXPECTED))
def test_no_launch_preset_is_refused_by_the_trainer(name, monkeypatch):
    """What `accelerate launch --config_file FILE` exports is what the trainer reads at start
    (sharding.launch_settings): every preset runs, the FSDP ones with the model's own layer classes as units."""
    from accelerate.utils import prepare_multi_gpu_env

    from vlm_grpo_ma.run import sharding

    args = _launch_args(name)
    for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    with mock.patch.dict(os.environ, prepare_multi_gpu_env(args)):
        settings = sharding.launch_settings()
    if ACCELERATE_EXPECTED[name][0] == "FSDP":
        assert settings == sharding.FSDPSettings((), reshard_after_forward=True)
    else:
        assert settings is None


def test_fsdp_units_are_each_familys_decoder_layers_and_vision_blocks():
    """With no class named in the launch config, each family's own _no_split_modules are the FSDP units."""
    import transformers

    for model_class, units in [
        ("Qwen2_5_VLForConditionalGeneration", {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"}),
        ("Qwen3VLForConditionalGeneration", {"Qwen3VLTextDecoderLayer", "Qwen3VLVisionBlock"}),
        ("Qwen3_5ForConditionalGeneration", {"Qwen3_5DecoderLayer", "Qwen3_5VisionBlock"}),
    ]:
        assert set(getattr(transformers, model_class)._no_split_modules) == units


def test_multi_process_launchers():
    ddp, cpu = _launch_args("ddp.yaml"), _launch_args("cpu-2proc.yaml")
    assert ddp.multi_gpu and ddp.num_processes == 8
    # multi_gpu routes to torchrun (num_processes workers); each becomes a MULTI_CPU process where CUDA is absent
    assert cpu.multi_gpu and cpu.num_processes == 2 and cpu.use_cpu and cpu.mixed_precision == "no"


# ----------------------------------------------------------------------------------------------------------
# training presets

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    "name, model, k, m, lora_rank, dtype",
    [
        ("qwen2.5-vl-3b-lora-grounding-t4a4.yaml", "Qwen/Qwen2.5-VL-3B-Instruct", 4, 4, 64, "bfloat16"),
        ("qwen2.5-vl-3b-lora-grounding-t16a1.yaml", "Qwen/Qwen2.5-VL-3B-Instruct", 16, 1, 64, "bfloat16"),
        ("qwen2.5-vl-7b-fsdp-grounding-t4a4.yaml", "Qwen/Qwen2.5-VL-7B-Instruct", 4, 4, 0, "float32"),
        ("qwen3-vl-4b-grounding-t4a4.yaml", "Qwen/Qwen3-VL-4B-Instruct", 4, 4, 0, "float32"),
        ("qwen3.5-4b-grounding-t4a4.yaml", "Qwen/Qwen3.5-4B", 4, 4, 0, "float32"),
    ],
)
def test_scale_out_presets(name, model, k, m, lora_rank, dtype):
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.model.name_or_path == model
    assert (cfg.rollout.num_thoughts, cfg.rollout.num_answers) == (k, m)
    assert cfg.answers_per_prompt == 16  # the paper's comparison holds the answer budget fixed
    assert cfg.model.lora_rank == lora_rank and cfg.model.dtype == dtype
    assert cfg.train.mixed_precision == "bf16"
    assert cfg.model.attn_implementation == "auto" and cfg.model.gradient_checkpointing
    assert cfg.data.task == "grounding"
    assert cfg.train.output_dir == f"runs/{name.removesuffix('.yaml')}"
    if lora_rank:
        assert cfg.model.lora_alpha == 128.0 and cfg.model.lora_dropout == 0.0
        assert cfg.model.lora_target_modules == LORA_TARGETS and cfg.model.freeze_vision


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key in ("model", "rollout", "algorithm", "data", "train", "logging"):
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[prefix + key] = value
    return flat


PRESETS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
PAIRS = [(name, name.replace("-t4a4.yaml", "-t16a1.yaml")) for name in PRESETS if name.endswith("-t4a4.yaml")
         and name.replace("-t4a4.yaml", "-t16a1.yaml") in PRESETS]


def test_every_grpo_baseline_preset_has_its_grpo_ma_pair():
    assert [pair[1] for pair in PAIRS] == [name for name in PRESETS if name.endswith("-t16a1.yaml")]
    assert len(PAIRS) == 3


@pytest.mark.parametrize("t4a4, t16a1", PAIRS)
def test_paired_presets_differ_only_in_k_m_and_what_m_forces(t4a4, t16a1):
    """T4A4 and its T16A1 baseline are one experiment: the same model, precision, data and optimiser; only K, M,
    the run directory, the estimator (T16A1 is plain GRPO) and (where T4A4 uses the thought baseline, which
    M = 1 cannot) the answer baseline differ."""
    ma = _flatten(load_config(ROOT / "configs" / t4a4).to_dict())
    grpo = _flatten(load_config(ROOT / "configs" / t16a1).to_dict())
    differing = {key for key in ma if ma[key] != grpo[key]}
    allowed = {"rollout.num_thoughts", "rollout.num_answers", "train.output_dir", "algorithm.advantage_estimator"}
    assert (ma["algorithm.advantage_estimator"], grpo["algorithm.advantage_estimator"]) == ("grpo_ma", "grpo")
    if ma["algorithm.answer_baseline"] == "thought":
        allowed.add("algorithm.answer_baseline")
        assert grpo["algorithm.answer_baseline"] == "prompt"
    assert differing <= allowed, sorted(differing - allowed)
    assert ma["rollout.num_thoughts"] * ma["rollout.num_answers"] == grpo["rollout.num_thoughts"] * grpo["rollout.num_answers"]


@pytest.mark.parametrize("name", [n for n in PRESETS if not n.startswith("tiny-")])
def test_gpu_presets_compute_in_bf16_and_say_so(name):
    """Every GPU preset computes in bf16 (train.mixed_precision), whatever dtype its weights are stored in; a
    preset whose comments say bf16 must set it (the 3B T4A4 preset once did not, unlike its baseline)."""
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.train.mixed_precision == "bf16", name
    assert cfg.model.dtype in ("float32", "bfloat16")


def test_fsdp_preset_names_its_launch_command():
    text = (ROOT / "configs" / "qwen2.5-vl-7b-fsdp-grounding-t4a4.yaml").read_text()
    assert "accelerate launch --config_file configs/accelerate/fsdp.yaml -m vlm_grpo_ma.train" in text
    assert "--config configs/qwen2.5-vl-7b-fsdp-grounding-t4a4.yaml" in text


# ----------------------------------------------------------------------------------------------------------
# scripts/gpu_check.py


@pytest.fixture(scope="module")
def gpu_check():
    return _gpu_check()


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from vlm_grpo_ma.model.tiny import TINY_MODEL_DIR

    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


def test_gpu_check_3b_config_has_qwen2_5_vl_3b_size(gpu_check, tiny_tokenizer):
    config = gpu_check.build_config("3b", tiny_tokenizer)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        2048,
        36,
        16,
        2,
    )
    assert (text.intermediate_size, text.vocab_size) == (11008, 151936)
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size, vision.intermediate_size) == (
        32,
        1280,
        2048,
        3420,
    )
    assert list(vision.fullatt_block_indexes) == [7, 15, 23, 31]
    assert config.image_token_id == tiny_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.device("meta"):  # counted, never allocated (~7.5 GB in bf16)
        model = gpu_check.build_model(config, device="meta", dtype="bfloat16")
    params = gpu_check.count_parameters(model)
    assert params == _qwen2_5_vl_parameter_count(config)
    assert abs(params - 3.75e9) / 3.75e9 < 0.01, params  # Qwen2.5-VL-3B-Instruct's published size


def _qwen2_5_vl_parameter_count(config) -> int:
    """Qwen2.5-VL's parameters counted by hand from its architecture (not from the built model): decoder
    layers with q/k/v biases and a tied lm_head (no weights of its own); vision blocks with RMSNorms, a fused qkv and a
    gated MLP, all with biases; the patch-merger MLP."""
    text, vision = config.text_config, config.vision_config
    h, kv = text.hidden_size, text.num_key_value_heads * (text.hidden_size // text.num_attention_heads)
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * text.intermediate_size + 2 * h
    text_params = text.vocab_size * h + text.num_hidden_layers * layer + h
    v, inter = vision.hidden_size, vision.intermediate_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * v
    block = 2 * v + (v * 3 * v + 3 * v) + (v * v + v) + 2 * (v * inter + inter) + (inter * v + v)
    merged = v * vision.spatial_merge_size**2
    merger = v + (merged * merged + merged) + (merged * vision.out_hidden_size + vision.out_hidden_size)
    return text_params + patch + vision.depth * block + merger


def test_gpu_check_tiny_model_builds_saves_and_loads(gpu_check, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    params = gpu_check.save_model_folder(tmp_path, "tiny", device="cpu", dtype="float32")
    assert params < 20_000_000
    model = AutoModelForImageTextToText.from_pretrained(tmp_path)
    processor = AutoProcessor.from_pretrained(tmp_path)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert gpu_check.count_parameters(model) == params
    assert model.config.text_config.vocab_size == 151936 > len(processor.tokenizer)
    ids = processor.tokenizer("<think>", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 151936)


def test_gpu_check_train_command(gpu_check, tmp_path):
    args = gpu_check.build_arg_parser().parse_args(["--steps", "3", "--lora", "train.seed=1"])
    args.device = "cuda"
    command = gpu_check.train_command(args, tmp_path / "model", tmp_path / "run")
    assert command[1:3] == ["-m", "vlm_grpo_ma.train"]
    assert command[command.index("--config") + 1].endswith("qwen2.5-vl-3b-lora-grounding-t4a4.yaml")
    overrides = [a for a in command if "=" in a]
    cfg = load_config(
        ROOT / "configs" / "qwen2.5-vl-3b-lora-grounding-t4a4.yaml", overrides
    )  # they all validate
    assert (cfg.train.steps, cfg.train.prompts_per_step, cfg.train.seed) == (3, 8, 1)
    assert (cfg.rollout.num_thoughts, cfg.rollout.num_answers) == (4, 4)
    assert (cfg.rollout.max_thought_tokens, cfg.rollout.max_answer_tokens) == (256, 32)
    assert (cfg.model.dtype, cfg.train.mixed_precision, cfg.model.attn_implementation) == (
        "bfloat16",
        "bf16",
        "auto",
    )
    assert cfg.model.gradient_checkpointing and cfg.model.min_pixels == cfg.model.max_pixels == 401408
    assert cfg.data.source is None and cfg.model.lora_rank == 64
    args.device = "cpu"
    cpu = load_config(None, [a for a in gpu_check.train_command(args, tmp_path, tmp_path) if "=" in a])
    assert (cpu.model.dtype, cpu.train.mixed_precision) == ("float32", "no")


def test_gpu_check_summary_reads_metrics(gpu_check):
    records = [
        {"step": 1, "time/step_seconds": 9.0, "time/rollout_seconds": 5.0, "time/generated_tokens_per_second": 10.0,
         "time/trained_tokens_per_second": 1.0, "time/peak_gpu_memory_gb": 40.0},
        {"step": 2, "time/step_seconds": 4.0, "time/rollout_seconds": 2.0, "time/generated_tokens_per_second": 30.0,
         "time/trained_tokens_per_second": 3.0, "time/peak_gpu_memory_gb": 41.5},
        {"step": 3, "time/step_seconds": 6.0, "time/rollout_seconds": 3.0, "time/generated_tokens_per_second": 50.0,
         "time/trained_tokens_per_second": 5.0, "time/peak_gpu_memory_gb": 41.0},
    ]  # fmt: skip
    log = "INFO model /x (Qwen2_5_VLForConditionalGeneration, 9 parameters, attention flash_attention_2, coordinate frame absolute_input)"
    result = gpu_check.summarize_run(records, log)
    assert result["attention"] == "flash_attention_2"
    assert result["first_step_seconds"] == 9.0 and result["step_seconds"] == 5.0  # step 1 is warm-up
    assert (result["generated_tokens_per_second"], result["trained_tokens_per_second"]) == (40.0, 4.0)
    assert result["peak_gpu_memory_gb"] == 41.5
    no_peak = gpu_check.summarize_run([{k: v for k, v in r.items() if "peak" not in k} for r in records], "")
    assert no_peak["peak_gpu_memory_gb"] is None and no_peak["attention"] is None
    assert gpu_check._fmt(None) == "n/a"


def test_gpu_check_mfu_counts_six_flops_per_trained_parameter_and_token(gpu_check):
    result = {"trainable_parameters": 3_000_000_000, "trained_tokens_per_second": 10_000.0}
    assert gpu_check.mfu(result, gpu_check.H200_BF16_DENSE_FLOPS) == pytest.approx(6 * 3e9 * 1e4 / 989e12)
    assert gpu_check.mfu(result, 0) is None and gpu_check.mfu({}, 989e12) is None


def test_gpu_check_budget_skips_a_section_that_does_not_fit(gpu_check, capsys):
    budget = gpu_check.Budget(100.0, {"T4A4": 120, "decode": 20})
    assert budget.allows("decode") and not budget.allows("T4A4")
    assert "skipped: the budget has" in capsys.readouterr().out
    budget_s = gpu_check.build_arg_parser().get_default("budget_s")
    estimates = gpu_check.H200_ESTIMATES
    # the default budget holds every section's estimate but vLLM training's and the split launch's, which are the
    # second call's (--sections model vllm split)
    assert sum(seconds for key, seconds in estimates.items() if key not in ("vllm", "split")) <= budget_s
    assert estimates["model"] + estimates["vllm"] + estimates["split"] <= budget_s
    chosen = gpu_check.Budget(100.0, {"model": 1, "vllm": 1, "decode": 1}, {"model", "vllm"})
    assert chosen.allows("vllm") and not chosen.allows("decode") and "not asked for (--sections)" in capsys.readouterr().out


def test_gpu_check_split_commands(gpu_check, tmp_path):
    """The split section's two launches: 2 processes, the last an engine process, one update ahead (S=1) or none
    (S=0); with vLLM on one GPU a smaller vLLM share (the trainer shares the GPU) and no sleep (the engine process
    samples through the update); on the CPU the CPU launch file."""
    args = gpu_check.build_arg_parser().parse_args([])
    args.device = "cuda"
    for gpus, share in ((1, gpu_check.SPLIT_SHARED_GPU_VLLM_SHARE), (2, 0.35)):
        for launch, staleness in (("S=1", 1), ("S=0", 0)):
            command = gpu_check.split_command(args, tmp_path / "model", tmp_path / "run", launch, engine="vllm", gpus=gpus, steps=3)
            assert command[command.index("--config_file") + 1].endswith("ddp.yaml") and command[command.index("--num_processes") + 1] == "2"
            cfg = load_config(ROOT / "configs" / "qwen2.5-vl-3b-grounding-t4a4.yaml", [a for a in command if "=" in a])
            assert (cfg.rollout.engine_processes, cfg.rollout.max_staleness, cfg.train.steps) == (1, staleness, 3), launch
            assert (cfg.rollout.engine, cfg.rollout.vllm_sleep, cfg.rollout.vllm_gpu_memory_utilization) == ("vllm", False, share)
    args.device = "cpu"
    command = gpu_check.split_command(args, tmp_path, tmp_path, "S=1", engine="hf", gpus=0, steps=2)
    assert command[command.index("--config_file") + 1].endswith("cpu-2proc.yaml")
    cfg = load_config(None, [a for a in command if "=" in a])
    assert (cfg.rollout.engine, cfg.rollout.max_staleness, cfg.model.dtype, cfg.train.num_threads) == ("hf", 1, "float32", 1)


def test_gpu_check_split_figures_and_overlap_bound(gpu_check):
    records = [
        {"rollout/staleness_max": 0, "rollout/logprob_gap_max": 2e-3, "time/trainer_idle_s": 9.0, "time/engine_idle_s": 0.0},
        {"rollout/staleness_max": 1, "rollout/logprob_gap_max": 0.5, "time/trainer_idle_s": 1.0, "time/engine_idle_s": 0.2,
         "rollout/importance_ess_answer": 0.9},
        {"rollout/staleness_max": 0, "rollout/logprob_gap_max": 3e-3, "time/trainer_idle_s": 3.0, "time/engine_idle_s": 0.4,
         "rollout/importance_ess_answer": 0.7},
    ]  # fmt: skip
    figures = gpu_check.split_figures(records)
    assert figures["staleness_max"] == [0, 1, 0]
    assert (figures["trainer_idle_s"], figures["engine_idle_s"]) == (2.0, pytest.approx(0.3))  # step 1 not in the means
    assert figures["logprob_gap_max_staleness_0"] == 3e-3  # the stale step's 0.5 holds an update: not counted
    assert figures["importance_ess_answer_min"] == 0.7
    none = gpu_check.split_figures([{"rollout/staleness_max": 1}])
    assert none["logprob_gap_max_staleness_0"] is None and none["importance_ess_answer_min"] is None
    # S=0: steps of 4 s of which the trainer waited 3 for its trees: overlapped, at best 3 s of 4
    assert gpu_check.overlap_bound({"step_seconds": 4.0, "rollout_seconds": 3.0}) == 0.75
    assert gpu_check.overlap_bound({"step_seconds": 4.0, "rollout_seconds": 1.0}) == 0.75
    assert gpu_check.overlap_bound({"step_seconds": None, "rollout_seconds": 1.0}) is None


@pytest.mark.slow
def test_gpu_check_cpu_self_check_prints_every_section(tmp_path):
    """The GPU check's own command on the CPU (tiny size, one step per run): every section prints, flash
    attention is reported as unavailable, the FSDP step as skipped, and the decode benchmark's figures appear."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--size", "tiny", "--device", "cpu", "--steps", "1", "--summary-json", str(tmp_path / "s.json")],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    titles = ["plan", *gpu_check_sections().values(), "summary"]
    for number, title in enumerate(titles, start=1):
        assert f"== [{number}/{len(titles)}] {title} ==" in out, title
    assert "flash_attention_2: not available on this machine" in out
    assert "skipped: 0 GPU(s) visible, the FSDP step needs 2" in out
    assert "decode step sampling" in out and "KV cache, one layer" in out
    for run in ("T4A4", "T16A1"):
        assert re.search(rf"{run}\s+step [\d.]+ s, generated [\d,]+ tok/s, trained [\d,]+ tok/s", out), run
    assert re.search(r"forward, sdpa: ratio [\d.]+x, log-prob max difference", out)
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:  # the engines section ran: both engines' trees timed
        # per engine: s/tree, tokens, hit rate (hf: -), prompt tokens prefilled, log-prob gap max and mean
        number = r"[\d.]+(?:e[+-]\d+)?"
        assert re.search(rf"model\s+\d+\.\d+M \|\s+[\d.]+\s+\d+\s+-\s+\d+\s+{number}\s+{number} \|\s+[\d.]+\s+\d+\s+[\d.]+\s+\d+\s+{number}\s+{number} \|", out), out[-2000:]
        # and a T4A4 run sampled with vLLM, exiting cleanly, its hit rate and gap printed
        assert re.search(r"1 process: exit code 0, traceback no, 2 steps; .* hit rate 0\.\d+, log-prob gap max", out), out[-2000:]
    # the split launch (the HF engine on the CPU): both launches run their 2 steps; S=0 samples every step with the
    # trainer's weights, S=1 with weights at most one update old and importance-corrected (its ESS is logged)
    number = r"\d+(?:\.\d+)?(?:e[+-]\d+)?"
    for launch, staleness, ess in (("S=1", "0 [01]", r"[01]\.\d{3}"), ("S=0", "0 0", "n/a")):
        line = (rf"  {launch}: exit code 0, traceback no, 2 of 2 steps; staleness max per step {staleness}; {number} s/step .*"
                rf" idle: trainer {number} s, engine {number} s; log-prob gap max at staleness 0 {number}; importance ESS \(answer\) min {ess}\n")  # fmt: skip
        assert re.search(line, out), launch
    assert re.search(r"S=1 / S=0 s/step [\d.]+; bound max\(r, u\)/\(r \+ u\) from the S=0 run 0\.\d+", out)
    figures = json.loads((tmp_path / "s.json").read_text())
    assert figures["forward"]["sdpa"]["logprob_max_abs_diff"] <= 1e-4


def gpu_check_sections():
    return _gpu_check().SECTIONS


@pytest.mark.parametrize("name", [n for n in PRESETS if not n.startswith("tiny-")])
def test_gpu_presets_sample_with_vllm_and_fit_by_the_memory_model(name):
    """Every GPU preset samples with vLLM (an engine in every process, the FSDP preset's too), and fits by the
    memory model with the engine's share counted: on one 80 GB GPU, or, for the full fine-tuning presets of the
    larger models, sharded over 8 (each preset's comment says which). Qwen3.5-4B too: its 248,320-token head and
    Gated DeltaNet layers make the update ~96 GB on one GPU."""
    from vlm_grpo_ma.model.architectures import architecture_of
    from vlm_grpo_ma.run.memory_model import estimate, verdict

    cfg = load_config(ROOT / "configs" / name)
    assert cfg.rollout.engine == "vllm", name
    needs_fsdp = "7b" in name or "qwen3-vl-4b" in name or "qwen3.5-4b" in name
    processes, strategy = (8, "fsdp") if needs_fsdp else (1, "ddp")
    e = estimate(architecture_of(cfg.model.name_or_path), cfg, processes, strategy, device_bytes=80 * 10**9)
    assert e.engine > e.engine_weights and verdict(e.peak, 80) == "fits", (name, e.peak)
