"""GPU check: a few GRPO-MA T4A4 steps of a Qwen2.5-VL-3B-sized model with random weights, then one summary.

    scripts/gpu_check.sh                      # 3B-sized, full fine-tuning settings, 5 steps (one H200: ~5 min)
    scripts/gpu_check.sh --lora               # the LoRA preset's settings
    scripts/gpu_check.sh --size tiny --device cpu --steps 2   # the script itself, on a CPU, in under a minute

What it does:
1. builds a ``Qwen2_5_VLForConditionalGeneration`` with the real Qwen2.5-VL-3B-Instruct architecture numbers
   (``SPECS["3b"]``) and random weights: nothing is downloaded. It is saved, in the training dtype, into a
   temporary folder with the project's tiny tokenizer and processor (their token ids are all below the 3B
   vocabulary size; ids the random model samples beyond the tiny vocabulary decode to nothing);
2. runs ``python -m vlm_grpo_ma.train`` on it with the 3B preset (``configs/qwen2.5-vl-3b-grounding-t4a4.yaml``,
   or the LoRA preset with ``--lora``) on the embedded grounding data, overriding: a few steps, 8 prompts per
   step, K=4 x M=4, thoughts of up to 256 tokens, answers of up to 32, bf16 weights and autocast, attention
   "auto", gradient checkpointing, and the embedded 168 px scenes upscaled to ~400k pixels (529 visual
   tokens per prompt, the size RefCOCO images get under the preset's max_pixels);
3. prints one summary from the run's metrics.jsonl: attention implementation, step time, generated and
   trained tokens per second, peak GPU memory (``time/peak_gpu_memory_gb``; "n/a" where the trainer does not
   log it) and total wall time.

A random model never writes ``</think>``, so every thought runs to the token limit and is closed by force:
the step does the maximum work of its settings, which is what a timing check wants. Rewards are ~0.
Extra ``section.key=value`` arguments after the options go to the trainer unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = {
    False: REPO / "configs" / "qwen2.5-vl-3b-grounding-t4a4.yaml",
    True: REPO / "configs" / "qwen2.5-vl-3b-lora-grounding-t4a4.yaml",
}

# Qwen2.5-VL-3B-Instruct's config.json (Qwen/Qwen2.5-VL-3B-Instruct on the Hugging Face hub), written from
# memory (nothing can be downloaded here). The shapes that set the parameter count and the compute give
# 3,754,622,976 parameters, the published "3.75B" (tests/test_presets.py). Less certain, and changing neither
# count nor compute of this check: max_window_layers (70; unused: use_sliding_window is false),
# max_position_embeddings (128000), tokens_per_second (2; videos only) and rope_theta (1e6).
SPECS = {
    "3b": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,  # head_dim 128
            num_key_value_heads=2,
            hidden_act="silu",
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            sliding_window=32768,
            max_window_layers=70,
            tie_word_embeddings=True,  # 3B ties lm_head to the embedding (7B does not)
            # mrope_section sums to head_dim / 2 = 64: temporal, height, width
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,  # = text hidden_size
            hidden_act="silu",
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,  # window attention over 112 px = 8x8 patches = 4x4 merged tokens
            fullatt_block_indexes=[7, 15, 23, 31],
            tokens_per_second=2,
        ),
        image_pixels=401408,  # 512 * 28 * 28, the presets' max_pixels; also the minimum, to upscale 168 px scenes
    ),
    # The same structure (3B vocabulary included, so that sampling ids the tiny tokenizer does not know is
    # exercised), shrunk so that the whole check runs on a CPU in well under a minute.
    "tiny": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,  # head_dim 32
            num_key_value_heads=1,
            hidden_act="silu",
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        ),
        vision=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=64,
            hidden_act="silu",
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
        image_pixels=None,  # the tiny processor's own sizes (84 px)
    ),
}
# Per-size defaults of the run (the 3B ones are the check's settings; tiny's keep the CPU run short).
RUN_DEFAULTS = {
    "3b": dict(prompts_per_step=8, max_thought_tokens=256, max_answer_tokens=32),
    "tiny": dict(prompts_per_step=2, max_thought_tokens=16, max_answer_tokens=8),
}
# Config keys this check sets whose effect lives in the core; a note is printed where no module of
# vlm_grpo_ma other than config.py mentions them yet (then the run does not do what the key says).
WIRED_KEYS = {
    "mixed_precision": "train.mixed_precision (bf16 autocast)",
    "lora_rank": "model.lora_rank (LoRA adapters)",
    "freeze_vision": "model.freeze_vision",
    "peak_gpu_memory": "the time/peak_gpu_memory_gb metric",
}


def tiny_processor():
    """The project's committed tiny tokenizer + Qwen2.5-VL processor (vlm_grpo_ma/assets/tiny-qwen2.5-vl)."""
    from transformers import AutoProcessor

    from vlm_grpo_ma.tiny import TINY_MODEL_DIR

    return AutoProcessor.from_pretrained(TINY_MODEL_DIR)


def build_config(size: str, tokenizer):
    """A ``Qwen2_5_VLConfig`` of ``SPECS[size]`` whose special-token ids are ``tokenizer``'s."""
    from transformers import Qwen2_5_VLConfig

    if size not in SPECS:
        raise ValueError(f"unknown size {size!r}; known sizes: {', '.join(SPECS)}")
    spec = SPECS[size]
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in [
        ("pad", "<|endoftext|>"), ("eos", "<|im_end|>"), ("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
        ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"),
    ]}  # fmt: skip
    if max(ids.values()) >= spec["text"]["vocab_size"] or len(tokenizer) > spec["text"]["vocab_size"]:
        raise ValueError(
            f"tokenizer of {len(tokenizer)} tokens does not fit vocab_size {spec['text']['vocab_size']}"
        )
    text = dict(
        spec["text"],
        bos_token_id=ids["pad"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        attention_dropout=0.0,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(spec["vision"]),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        bos_token_id=ids["pad"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=spec["text"]["tie_word_embeddings"],
    )


def build_model(config, *, device: str = "cpu", dtype: str = "float32", seed: int = 0):
    """Random weights, allocated directly on ``device`` in ``dtype`` (no fp32 CPU copy of a 3B model)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def save_model_folder(out_dir: Path, size: str, *, device: str, dtype: str) -> int:
    """Build the model of ``size`` and save it with the tiny processor into ``out_dir``; returns its parameter count."""
    processor = tiny_processor()
    model = build_model(build_config(size, processor.tokenizer), device=device, dtype=dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    params = count_parameters(model)
    del model
    return params


def visual_tokens(side: int, pixels: int | None, patch: int = 14, merge: int = 2) -> str:
    """How a ``side`` px square scene is resized with min = max = ``pixels`` and how many tokens it becomes."""
    if pixels is None:
        return "the tiny processor's own sizes"
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    h, w = smart_resize(side, side, factor=patch * merge, min_pixels=pixels, max_pixels=pixels)
    return f"{side}x{side} px scenes -> {w}x{h} px, {(h // (patch * merge)) * (w // (patch * merge))} visual tokens per prompt"


def unwired_notes() -> list[str]:
    """Config keys this check relies on that no module of vlm_grpo_ma except config.py mentions (yet)."""
    sources = "\n".join(
        p.read_text(errors="replace") for p in (REPO / "vlm_grpo_ma").glob("*.py") if p.name != "config.py"
    )
    return [
        f"{what}: not read by vlm_grpo_ma yet (only config.py names it)"
        for key, what in WIRED_KEYS.items()
        if key not in sources
    ]


class GpuMemoryPoller:
    """Highest `nvidia-smi` memory.used of GPU 0 while the run lasts: the whole device (CUDA context and the
    allocator's cache included), a cross-check of the trainer's own peak, which counts allocated tensors."""

    def __init__(self, interval: float = 0.5):
        self.interval, self.peak_mib, self._stop = interval, None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True, text=True, timeout=10,
                ).stdout.strip()  # fmt: skip
                used = float(out.splitlines()[0])
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return
            self._stop.wait(self.interval)

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)


def train_command(args, model_dir: Path, run_dir: Path) -> list[str]:
    run = RUN_DEFAULTS[args.size]
    on_gpu = args.device == "cuda"
    pixels = SPECS[args.size]["image_pixels"]
    command = [
        sys.executable, "-m", "vlm_grpo_ma.train",
        "--config", str(PRESETS[args.lora]),
        "--output-dir", str(run_dir),
        f"model.name_or_path={model_dir}",
        "data.task=grounding",
        "data.source=null",  # the embedded scenes
        f"train.steps={args.steps}",
        f"train.prompts_per_step={args.prompts_per_step or run['prompts_per_step']}",
        "rollout.num_thoughts=4",
        "rollout.num_answers=4",
        f"rollout.max_thought_tokens={args.max_thought_tokens or run['max_thought_tokens']}",
        f"rollout.max_answer_tokens={args.max_answer_tokens or run['max_answer_tokens']}",
        f"model.dtype={'bfloat16' if on_gpu else 'float32'}",
        # quoted: a bare `no` is YAML 1.1 for false, which the config rejects as not a string
        f"train.mixed_precision={'bf16' if on_gpu else repr('no')}",
        "model.attn_implementation=auto",
        "model.gradient_checkpointing=true",
        f"model.min_pixels={'null' if pixels is None else pixels}",
        f"model.max_pixels={'null' if pixels is None else pixels}",
        f"train.checkpoint_every={args.steps}",  # the trainer always saves after the last step: only that one
        "train.keep_checkpoints=1",
        "train.eval_every=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.rollout_samples_per_step=1",
    ]  # fmt: skip
    return command + list(args.overrides)


def run_streaming(command: list[str], env: dict, log_path: Path) -> tuple[int, str]:
    """Run ``command`` from the repository root, echoing its output and keeping it in ``log_path``."""
    lines = []
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc,
    ):
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            lines.append(line)
        proc.wait()
    return proc.returncode, "".join(lines)


def _mean(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def summarize_run(records: list[dict], log_text: str) -> dict:
    """Timing and memory figures of a run from its metrics.jsonl records and its log."""
    steady = records[1:] if len(records) > 1 else records  # step 1 carries CUDA/allocator warm-up
    peaks = [r.get("time/peak_gpu_memory_gb") for r in records]
    peaks = [p for p in peaks if isinstance(p, (int, float))]
    attention = re.findall(r"attention (\w+), coordinate frame", log_text)
    trainable = re.findall(r"trainable: ([\d,]+ of [\d,]+) parameters trainable \(([\d.]+%)\)", log_text)
    return {
        "steps_logged": len(records),
        "attention": attention[-1] if attention else None,
        "trainable": f"{trainable[-1][0]} ({trainable[-1][1]})" if trainable else None,
        "first_step_seconds": records[0].get("time/step_seconds") if records else None,
        "step_seconds": _mean([r.get("time/step_seconds") for r in steady]),
        "rollout_seconds": _mean([r.get("time/rollout_seconds") for r in steady]),
        "generated_tokens_per_second": _mean([r.get("time/generated_tokens_per_second") for r in steady]),
        "trained_tokens_per_second": _mean([r.get("time/trained_tokens_per_second") for r in steady]),
        "thought_tokens": _mean([r.get("rollout/thought_tokens") for r in steady]),
        "answer_tokens": _mean([r.get("rollout/answer_tokens") for r in steady]),
        "logprob_mismatch_max": max(
            (
                r["train/logprob_mismatch_max"]
                for r in records
                if isinstance(r.get("train/logprob_mismatch_max"), (int, float))
            ),
            default=None,
        ),
        "peak_gpu_memory_gb": max(peaks) if peaks else None,
    }


def _fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def environment_line(device: str) -> str:
    import accelerate
    import torch
    import transformers

    from vlm_grpo_ma.policy import pick_attn_implementation

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU run)"
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}; GPU: {gpu}; attention 'auto' resolves to "
        f"{pick_attn_implementation('auto') if device == 'cuda' else 'sdpa'}"
    )


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh",
        description="A few GRPO-MA T4A4 steps of a random-weight Qwen2.5-VL-3B-sized model; prints timing and memory.",
        epilog="Trailing section.key=value arguments are passed to the trainer after the check's own overrides.",
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="training steps (default 5; step 1 counts as warm-up)"
    )
    parser.add_argument(
        "--size",
        choices=sorted(SPECS),
        default="3b",
        help="3b: the real 3B architecture; tiny: a CPU-sized copy",
    )
    parser.add_argument(
        "--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when available"
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="use the LoRA preset (configs/qwen2.5-vl-3b-lora-grounding-t4a4.yaml)",
    )
    parser.add_argument("--prompts-per-step", type=int, help="default 8 (3b), 2 (tiny)")
    parser.add_argument("--max-thought-tokens", type=int, help="default 256 (3b), 16 (tiny)")
    parser.add_argument("--max-answer-tokens", type=int, help="default 32 (3b), 8 (tiny)")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="where the model and the run go, kept afterwards (default: a temporary folder)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (model, run, log) afterwards"
    )
    parser.add_argument("--summary-json", type=Path, help="also write the summary as JSON to this file")
    parser.add_argument("overrides", nargs="*", help="extra trainer overrides section.key=value")
    return parser


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_arg_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(
        PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks CUDA whenever it sees it

    print(f"[gpu_check] {environment_line(args.device)}", flush=True)
    notes = unwired_notes()
    for note in notes:
        print(f"[gpu_check] note: {note}", flush=True)

    if args.work_dir is not None:
        args.keep = True  # never delete a folder the caller named
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir, run_dir, log_path = work / "model", work / "run", work / "train.log"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run, never a resume of an earlier check
    try:
        t0 = time.perf_counter()
        params = save_model_folder(
            model_dir, args.size, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32"
        )
        build_seconds = time.perf_counter() - t0
        print(f"[gpu_check] built and saved a random {args.size} Qwen2.5-VL ({params / 1e9:.3f}B parameters) "
              f"in {build_seconds:.1f} s -> {model_dir}", flush=True)  # fmt: skip
        command = train_command(args, model_dir, run_dir)
        print("[gpu_check] " + " ".join(command[1:]), flush=True)
        t0 = time.perf_counter()
        with GpuMemoryPoller() as poller:
            returncode, log_text = run_streaming(command, env, log_path)
        train_seconds = time.perf_counter() - t0
        from vlm_grpo_ma.metrics import read_metrics

        records = read_metrics(run_dir)
        result = summarize_run(records, log_text)
        result.update(
            size=args.size,
            lora=args.lora,
            device=args.device,
            parameters=params,
            steps=args.steps,
            trainer_exit_code=returncode,
            build_and_save_seconds=build_seconds,
            train_command_seconds=train_seconds,
            nvidia_smi_peak_gib=None if poller.peak_mib is None else poller.peak_mib / 1024,
            images=visual_tokens(168, SPECS[args.size]["image_pixels"]),
            notes=notes,
            total_seconds=time.perf_counter() - started,
        )
        run = RUN_DEFAULTS[args.size]
        print(
            "\n===== gpu_check summary =====\n"
            f"model           Qwen2.5-VL {args.size} architecture, random weights, {params / 1e9:.3f}B parameters"
            f"{' (LoRA preset)' if args.lora else ' (full fine-tuning preset)'}\n"
            f"settings        T4A4, {args.prompts_per_step or run['prompts_per_step']} prompts/step, thoughts <= "
            f"{args.max_thought_tokens or run['max_thought_tokens']} tokens, answers <= "
            f"{args.max_answer_tokens or run['max_answer_tokens']}; {result['images']}\n"
            f"attention       {result['attention'] or 'n/a'}\n"
            f"trainable       {result['trainable'] or 'n/a'} parameters\n"
            f"steps           {len(records)} of {args.steps} logged; trainer exit code {returncode}\n"
            f"step time       {_fmt(result['step_seconds'], '.2f', ' s')} (rollout {_fmt(result['rollout_seconds'], '.2f', ' s')};"
            f" first step {_fmt(result['first_step_seconds'], '.2f', ' s')}, not in the means)\n"
            f"generated       {_fmt(result['generated_tokens_per_second'], ',.0f', ' tokens/s')}"
            f" (mean thought {_fmt(result['thought_tokens'], '.0f')} / answer {_fmt(result['answer_tokens'], '.0f')} tokens)\n"
            f"trained         {_fmt(result['trained_tokens_per_second'], ',.0f', ' tokens/s')}\n"
            f"peak GPU memory {_fmt(result['peak_gpu_memory_gb'], '.1f', ' GiB')} (time/peak_gpu_memory_gb: allocated tensors);"
            f" nvidia-smi max {_fmt(result['nvidia_smi_peak_gib'], '.1f', ' GiB')} (whole device)\n"
            f"logprob check   max |sampling - training log-prob| {_fmt(result['logprob_mismatch_max'], '.3g')}\n"
            f"wall time       {result['total_seconds']:.1f} s total (model build+save {build_seconds:.1f} s,"
            f" trainer {train_seconds:.1f} s incl. load and final checkpoint)\n"
            + "".join(f"note            {note}\n" for note in notes),
            flush=True,
        )
        if args.summary_json:
            args.summary_json.parent.mkdir(parents=True, exist_ok=True)
            args.summary_json.write_text(json.dumps(result, indent=2))
        if returncode != 0:
            print(
                f"[gpu_check] the trainer failed (exit code {returncode}); its log: {log_path}",
                file=sys.stderr,
            )
            args.keep = True
            return returncode
        if len(records) < args.steps:
            print(f"[gpu_check] only {len(records)} of {args.steps} steps in metrics.jsonl", file=sys.stderr)
            return 1
        return 0
    finally:
        if args.keep:
            print(f"[gpu_check] kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
