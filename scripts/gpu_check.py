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
import dataclasses
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
sys.path.insert(0, str(REPO))
from vlm_grpo_ma.model import architectures  # noqa: E402
from vlm_grpo_ma.model.architectures import QWEN2_5_VL_3B  # noqa: E402

PRESETS = {
    False: REPO / "configs" / "qwen2.5-vl-3b-grounding-t4a4.yaml",
    True: REPO / "configs" / "qwen2.5-vl-3b-lora-grounding-t4a4.yaml",
}

# Qwen2.5-VL-3B-Instruct's architecture numbers: vlm_grpo_ma/model/architectures.py (one source for every script).
THREE_B_TEXT = QWEN2_5_VL_3B.text
THREE_B_VISION = QWEN2_5_VL_3B.vision
SPECS = {
    "3b": dict(
        text=THREE_B_TEXT,
        vision=THREE_B_VISION,
        image_pixels=401408,  # 512 * 28 * 28, the presets' max_pixels; also the minimum, to upscale 168 px scenes
    ),
    # The same structure (3B vocabulary included, so that sampling ids the tiny tokenizer does not know is
    # exercised), shrunk so that the whole check runs on a CPU in well under a minute.
    "tiny": dict(
        text=architectures.shrunk(QWEN2_5_VL_3B).text,
        vision=architectures.shrunk(QWEN2_5_VL_3B).vision,
        image_pixels=None,  # the tiny processor's own sizes (84 px)
    ),
}  # fmt: skip
# Per-size defaults of the run (the 3B ones are the check's settings; tiny's keep the CPU run short).
RUN_DEFAULTS = {
    "3b": dict(prompts_per_step=8, max_thought_tokens=256, max_answer_tokens=32),
    "tiny": dict(prompts_per_step=1, max_thought_tokens=8, max_answer_tokens=4),
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

    from vlm_grpo_ma.model.tiny import TINY_MODEL_DIR

    return AutoProcessor.from_pretrained(TINY_MODEL_DIR)


def build_config(size: str, tokenizer):
    """A ``Qwen2_5_VLConfig`` of ``SPECS[size]`` whose special-token ids are ``tokenizer``'s."""
    if size not in SPECS:
        raise ValueError(f"unknown size {size!r}; known sizes: {', '.join(SPECS)}")
    spec = SPECS[size]
    return architectures.build_config(dataclasses.replace(QWEN2_5_VL_3B, text=spec["text"], vision=spec["vision"]), tokenizer)


build_model = architectures.build_model
count_parameters = architectures.count_parameters


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


def train_command(
    args, model_dir: Path, run_dir: Path, *, thoughts: int = 4, answers: int = 4, launcher: list[str] | None = None, steps: int | None = None,
    engine: str = "hf",
) -> list[str]:  # fmt: skip
    """The trainer's command line for a (thoughts x answers) run; ``launcher`` replaces ``python`` (accelerate);
    ``engine``: rollout.engine (the training sections time the HF engine; section 'vllm' the vLLM one)."""
    run = RUN_DEFAULTS[args.size]
    on_gpu = args.device == "cuda"
    pixels = SPECS[args.size]["image_pixels"]
    steps = steps or args.steps
    command = [
        *(launcher or [sys.executable]), "-m", "vlm_grpo_ma.train",
        "--config", str(PRESETS[args.lora]),
        "--output-dir", str(run_dir),
        f"model.name_or_path={model_dir}",
        "data.task=grounding",
        "data.source=null",  # the embedded scenes
        f"train.steps={steps}",
        f"train.prompts_per_step={args.prompts_per_step or run['prompts_per_step']}",
        f"rollout.num_thoughts={thoughts}",
        f"rollout.num_answers={answers}",
        f"rollout.max_thought_tokens={args.max_thought_tokens or run['max_thought_tokens']}",
        f"rollout.max_answer_tokens={args.max_answer_tokens or run['max_answer_tokens']}",
        f"model.dtype={'bfloat16' if on_gpu else 'float32'}",
        # quoted: a bare `no` is YAML 1.1 for false, which the config rejects as not a string
        f"train.mixed_precision={'bf16' if on_gpu else repr('no')}",
        "model.attn_implementation=auto",
        "model.gradient_checkpointing=true",
        f"model.min_pixels={'null' if pixels is None else pixels}",
        f"model.max_pixels={'null' if pixels is None else pixels}",
        f"train.checkpoint_every={steps}",  # the trainer always saves after the last step: only that one
        "train.keep_checkpoints=1",
        "train.eval_every=0",
        "logging.report_to=[]",
        "logging.progress_bar=false",
        "logging.rollout_samples_per_step=1",
        f"rollout.engine={engine}",
        *(["rollout.vllm_sleep=false"] if engine == "vllm" and not on_gpu else []),  # sleep mode needs a GPU
    ]  # fmt: skip
    return command + list(args.overrides)


def run_streaming(command: list[str], env: dict, log_path: Path, *, timeout: float, echo: bool = True, indent: str = "") -> tuple[int, str]:
    """Run ``command`` from the repository root, keeping its output in ``log_path`` (and echoing it); killed
    after ``timeout`` seconds (the budget left), then its exit code is -9."""
    lines = []
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True,
        ) as proc,
    ):
        timer = threading.Timer(max(timeout, 1.0), proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                if echo:
                    sys.stdout.write(indent + line)
                log.write(line)
                lines.append(line)
            proc.wait()
        finally:
            timer.cancel()
    return proc.returncode, "".join(lines)


def _numbers(values) -> list:
    return [v for v in values if isinstance(v, (int, float))]


def _mean(values):
    values = _numbers(values)
    return sum(values) / len(values) if values else None


def _steady(records: list[dict]) -> list[dict]:
    """The records the means are taken over: all but step 1, which carries CUDA/allocator warm-up."""
    return records[1:] if len(records) > 1 else records


def summarize_run(records: list[dict], log_text: str) -> dict:
    """Timing and memory figures of a run from its metrics.jsonl records and its log."""
    steady = _steady(records)
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
                r["rollout/logprob_gap_max"]
                for r in records
                if isinstance(r.get("rollout/logprob_gap_max"), (int, float))
            ),
            default=None,
        ),
        "peak_gpu_memory_gb": max(peaks) if peaks else None,
        "trainable_parameters": int(trainable[-1][0].split(" of ")[0].replace(",", "")) if trainable else None,
    }


def _fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def environment_line(device: str) -> str:
    import accelerate
    import torch
    import transformers

    from vlm_grpo_ma.model.loading import pick_attn_implementation

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU run)"
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}; GPU: {gpu}; attention 'auto' resolves to "
        f"{pick_attn_implementation('auto') if device == 'cuda' else 'sdpa'}"
    )


H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA's H200 SXM bf16 dense tensor-core peak (the 1,979 TFLOPs figure is with sparsity)

# Seconds each section is expected to take on one H200 at the 3B size (estimates, not measurements: no GPU
# has run this yet; they assume ~25 ms per decoded token of 32-128 rows and ~5 s per training update of the
# 128 T4A4 rows with gradient checkpointing). The budget check compares them with the time left.
H200_ESTIMATES = {
    "model": 45,  # build the random 3B in bf16 on the GPU, save 7.5 GB
    "T4A4": 120,  # trainer start + load ~35 s, 3 steps ~15 s each, final checkpoint (model + AdamW state) ~40 s
    "T16A1": 110,  # the same with 16 thoughts of 1 answer (more thought rows, fewer answer rows)
    "forward": 50,  # shared vs re-encoded training forward, sdpa and flash_attention_2, 2 prompts, 1 repeat
    "fsdp": 100,  # two processes, 2 steps (skipped with one GPU)
    "decode": 20,  # scripts/bench_decode_step.py
    "engines": 90,  # vLLM start (~40 s with CUDA graphs) + 2 alternating rounds of each engine (skipped without vLLM)
    "vllm": 200,  # T4A4 with vLLM: 1 GPU; with 2 GPUs also two engines and one TP-2 engine (~60 s each)
    # two 2-process launches (S=1, S=0) of 3 T4A4 steps, ~110 s each: imports ~15 s, the engine process's vLLM
    # start ~40 s (beside the trainer's ~35 s load), 3 steps ~10 s each, the final checkpoint (model + AdamW) ~40 s
    "split": 220,
}
SECTIONS = {
    "model": "random model",
    "T4A4": "T4A4 training run",
    "T16A1": "T16A1 training run",
    "forward": "training forward: shared prefixes vs re-encoded rows",
    "fsdp": "2-GPU FSDP step",
    "decode": "decode-step benchmark (scripts/bench_decode_step.py)",
    "engines": "rollout engines: vLLM vs HF (python -m vlm_grpo_ma.tools.bench_engines)",
    "vllm": "T4A4 training with vLLM in every process: 1 GPU, two engines, one TP-2 engine",
    "split": "split launch: an engine process beside a trainer, S=1 vs S=0",
}
# The split section's launches (issue 49; the placements of scripts/bench_split.py): the last of 2 processes only
# samples, one update ahead of the trainer (S=1) or waiting for each update (S=0, no overlap).
SPLIT_LAUNCHES = {
    "S=1": ["rollout.engine_processes=1", "rollout.max_staleness=1"],
    "S=0": ["rollout.engine_processes=1", "rollout.max_staleness=0"],
}
# vLLM's share of the GPU when the engine process and the trainer share one GPU (the engine never sleeps there: it
# samples while the trainer updates). 0.25 of an 80 GB GPU (20 GB) holds the engine's 3B weights (7.5 GB in bf16),
# its profiling peak and a KV cache many times the step's ~17k tokens; the trainer of the check's settings needs
# ~38 GB (python -m vlm_grpo_ma.memory --processes 2 --engine-processes 1 with the check's overrides), so ~60 GB
# of 80 are planned with the weight push and two CUDA contexts, ~20 GB left for the two allocators' slack. The
# presets' 0.35 (28 GB) would leave about half that; a larger cache would not make this check's steps faster.
SPLIT_SHARED_GPU_VLLM_SHARE = 0.25


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh",
        description="GRPO-MA T4A4 and T16A1 steps of a random-weight Qwen2.5-VL-3B-sized model, the training forward "
        "two ways, a 2-GPU FSDP step and the decode-step benchmark; prints timing, throughput, MFU and memory.",
        epilog="Trailing section.key=value arguments are passed to the trainer after the check's own overrides.",
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3; step 1 counts as warm-up)")
    parser.add_argument("--size", choices=sorted(SPECS), default="3b", help="3b: the real 3B architecture; tiny: a CPU-sized copy")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when available")
    parser.add_argument("--lora", action="store_true", help="use the LoRA preset (configs/qwen2.5-vl-3b-lora-grounding-t4a4.yaml)")
    parser.add_argument("--prompts-per-step", type=int, help="default 8 (3b), 1 (tiny)")
    parser.add_argument("--max-thought-tokens", type=int, help="default 256 (3b), 8 (tiny)")
    parser.add_argument("--max-answer-tokens", type=int, help="default 32 (3b), 4 (tiny)")
    parser.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget; a section whose estimate does not fit in what is left is skipped (default 560)")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), metavar="SECTION",
                        help=f"the sections to run (default all: {' '.join(SECTIONS)}; the model is built for any that needs it). "
                             "One H200's 560 s hold all but 'vllm' and 'split'; run those as a second call: --sections model vllm split")
    parser.add_argument("--work-dir", type=Path, help="where the model and the runs go, kept afterwards (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (model, runs, logs) afterwards")
    parser.add_argument("--summary-json", type=Path, help="also write the figures as JSON to this file")
    parser.add_argument("overrides", nargs="*", help="extra trainer overrides section.key=value")
    return parser


class Budget:
    """The wall-clock budget: a section runs only when its estimate fits in what is left; subprocesses are
    killed when the budget runs out, so the check never overruns it."""

    def __init__(self, seconds: float, estimates: dict[str, float], sections=None):
        self.started, self.seconds, self.estimates = time.perf_counter(), seconds, estimates
        self.sections = set(estimates if sections is None else sections)  # the ones --sections asked for

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def allows(self, section: str) -> bool:
        if section not in self.sections:
            print("  not asked for (--sections)", flush=True)
            return False
        if self.estimates[section] <= self.left():
            return True
        print(f"  skipped: the budget has {max(self.left(), 0):.0f} s left, this section is estimated at "
              f"{self.estimates[section]:.0f} s (--budget-s {self.seconds:.0f})", flush=True)  # fmt: skip
        return False


def header(number: int, title: str) -> None:
    print(f"\n== [{number}/{len(SECTIONS) + 2}] {title} ==", flush=True)


def mfu(result: dict, peak_flops: float) -> float | None:
    """Model FLOPs utilisation of the training forward + backward: 6 x trainable parameters x trained tokens per
    second over the peak. 6N per token (2N forward, 4N backward); attention's own FLOPs, the frozen vision
    tower's forward and the recompute of gradient checkpointing (~2N more) are not counted."""
    n, rate = result.get("trainable_parameters"), result.get("trained_tokens_per_second")
    return None if not n or not rate or not peak_flops else 6 * n * rate / peak_flops


def training_section(args, key: str, model_dir: Path, work: Path, env: dict, budget: Budget, thoughts: int, answers: int) -> dict:
    run_dir, log_path = work / f"run-{key}", work / f"train-{key}.log"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume of an earlier check
    command = train_command(args, model_dir, run_dir, thoughts=thoughts, answers=answers)
    print("  " + " ".join(command[1:]), flush=True)
    started = time.perf_counter()
    with GpuMemoryPoller() as poller:
        returncode, log_text = run_streaming(command, env, log_path, timeout=budget.left(), echo=False)
    from vlm_grpo_ma.run.metrics import read_metrics

    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    result = summarize_run(records, log_text)
    peak_flops = H200_BF16_DENSE_FLOPS if args.device == "cuda" else None
    result.update(
        trainer_exit_code=returncode, seconds=time.perf_counter() - started, mfu=mfu(result, peak_flops or 0),
        nvidia_smi_peak_gib=None if poller.peak_mib is None else poller.peak_mib / 1024,
    )  # fmt: skip
    print(
        f"  attention {result['attention'] or 'n/a'}; trainable {result['trainable'] or 'n/a'}; "
        f"{len(records)} of {args.steps} steps logged, trainer exit code {returncode} ({result['seconds']:.0f} s)\n"
        f"  step time        {_fmt(result['step_seconds'], '.2f', ' s')} (rollout {_fmt(result['rollout_seconds'], '.2f', ' s')};"
        f" first step {_fmt(result['first_step_seconds'], '.2f', ' s')}, not in the means)\n"
        f"  generated        {_fmt(result['generated_tokens_per_second'], ',.0f', ' tokens/s')}"
        f" (mean thought {_fmt(result['thought_tokens'], '.0f')} / answer {_fmt(result['answer_tokens'], '.0f')} tokens)\n"
        f"  trained          {_fmt(result['trained_tokens_per_second'], ',.0f', ' tokens/s')} (over the update's time)\n"
        f"  MFU (train f/b)  {_fmt(None if result['mfu'] is None else 100 * result['mfu'], '.1f', '%')}"
        f" (6 x trainable parameters x trained tokens/s over {'989 TFLOPs, H200 bf16 dense' if peak_flops else 'no GPU peak: CPU run'};"
        f" attention and checkpoint recompute not counted)\n"
        f"  peak memory      {_fmt(result['peak_gpu_memory_gb'], '.1f', ' GiB')} allocated (time/peak_gpu_memory_gb);"
        f" nvidia-smi max {_fmt(result['nvidia_smi_peak_gib'], '.1f', ' GiB')} (whole device)\n"
        f"  logprob check    max |sampling - training log-prob| {_fmt(result['logprob_mismatch_max'], '.3g')}",
        flush=True,
    )
    if returncode != 0:
        print(f"  the trainer failed (exit code {returncode}); its log: {log_path}", flush=True)
        args.keep = True
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the 3B's checkpoint is ~20 GB of disk
    return result


def flash_attention_available(device: str) -> str | None:
    """None when flash_attention_2 can run here, else why not."""
    import importlib.util

    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return "not available on this machine (no CUDA)"
    if importlib.util.find_spec("flash_attn") is None:
        return "not available on this machine (flash_attn not importable)"
    return None


def forward_section(args, model_dir: Path, budget: Budget) -> dict:
    """The training log-probs + backward of one T4A4 tree per prompt, tree-shared against re-encoded rows
    (``vlm_grpo_ma.bench.bench_train``), under sdpa and flash_attention_2: time ratio and log-prob agreement
    (flash_attention_2 sees the padded holes the shared forward leaves in the KV cache)."""
    import torch

    from vlm_grpo_ma.model import lora
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.tools.bench import bench_train
    from vlm_grpo_ma.tools.bench_inputs import BenchTree, bench_prompts

    run = RUN_DEFAULTS[args.size]
    pixels = SPECS[args.size]["image_pixels"]
    tree = BenchTree(
        max_thought_tokens=args.max_thought_tokens or run["max_thought_tokens"],
        max_answer_tokens=args.max_answer_tokens or run["max_answer_tokens"], repeats=1, warmup=int(args.device == "cuda"),
    )  # fmt: skip
    results = {}
    for attention in ("sdpa", "flash_attention_2"):
        why_not = flash_attention_available(args.device) if attention == "flash_attention_2" else None
        if why_not:
            print(f"  {attention:<17}: {why_not}", flush=True)
            results[attention] = why_not
            continue
        policy = load_policy(
            str(model_dir), dtype="bfloat16" if args.device == "cuda" else "float32", attn_implementation=attention,
            min_pixels=pixels, max_pixels=pixels, device=args.device,
        )  # fmt: skip
        lora.freeze_vision(policy.model)  # as the presets train
        out = bench_train(policy, bench_prompts(policy, 2 if args.size == "3b" else 1), tree, micro_batch_rows=16)
        results[attention] = out
        print(
            f"  {attention:<17}: shared {out['shared_s']:.2f} s, re-encoded {out['reencode_s']:.2f} s, ratio {out['ratio']:.2f}x "
            f"(tokens encoded {out['tokens_encoded_shared']:,} vs {out['tokens_encoded_reencode']:,}); "
            f"log-prob max |shared - re-encoded| {out['logprob_max_abs_diff']:.2e}, gradient max relative difference "
            f"{out['grad_max_abs_diff_relative']:.2e}",
            flush=True,
        )
        del policy
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


def fsdp_section(args, model_dir: Path, work: Path, env: dict, budget: Budget) -> dict | str:
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if gpus < 2:
        line = f"skipped: {gpus} GPU(s) visible, the FSDP step needs 2"
        print(f"  {line}", flush=True)
        return line
    run_dir = work / "run-fsdp"
    shutil.rmtree(run_dir, ignore_errors=True)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs/accelerate/fsdp.yaml"), "--num_processes", "2"]
    command = train_command(args, model_dir, run_dir, launcher=launcher, steps=2)
    print("  " + " ".join(command[1:]), flush=True)
    returncode, log_text = run_streaming(command, env, work / "train-fsdp.log", timeout=budget.left(), echo=False)
    from vlm_grpo_ma.run.metrics import read_metrics

    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    last = records[-1] if records else {}
    held = {k: v for k, v in last.items() if k.startswith("memory/rank")}
    print(f"  exit code {returncode}; {len(records)} of 2 steps; step 2 time {_fmt(last.get('time/step_seconds'), '.2f', ' s')}; "
          f"peak memory {_fmt(last.get('time/peak_gpu_memory_gb'), '.1f', ' GiB')} (rank 0)", flush=True)  # fmt: skip
    for key, value in sorted(held.items()):
        print(f"  {key} {value / 2**30:.2f} GiB", flush=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"exit_code": returncode, "records": records}


def decode_section(args, work: Path, env: dict, budget: Budget) -> str:
    small = [] if args.device == "cuda" else ["--rows", "4", "--repeats", "1", "--cache-rows", "4", "--cache-prompt", "32", "--cache-steps", "8"]
    command = [sys.executable, str(REPO / "scripts" / "bench_decode_step.py"), "--device", args.device, *small]
    returncode, text = run_streaming(command, env, work / "bench_decode_step.log", timeout=budget.left(), indent="  ")
    if returncode != 0:
        print(f"  bench_decode_step.py failed (exit code {returncode})", flush=True)
    return text


def engines_section(args, model_dir: Path, work: Path, env: dict, budget: Budget) -> str:
    """The T4A4 rollout through each engine on the same prompts (vlm_grpo_ma/tools/bench_engines.py), when vLLM is
    installed (scripts/setup.sh --vllm)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("  skipped: vLLM is not installed (scripts/setup.sh --vllm)", flush=True)
        return "skipped: no vLLM"
    run = RUN_DEFAULTS[args.size]
    pixels = SPECS[args.size]["image_pixels"]
    command = [sys.executable, "-m", "vlm_grpo_ma.tools.bench_engines", str(model_dir), "--device", args.device,
               "--prompts", str(args.prompts_per_step or run["prompts_per_step"]),
               "--thought-tokens", str(args.max_thought_tokens or run["max_thought_tokens"]),
               "--answer-tokens", str(args.max_answer_tokens or run["max_answer_tokens"]),
               *(["--max-pixels", str(pixels)] if pixels else [])]  # fmt: skip
    returncode, text = run_streaming(command, env, work / "bench_engines.log", timeout=budget.left(), indent="  ")
    if returncode != 0:
        print(f"  bench_engines failed (exit code {returncode})", flush=True)
    return text


def vllm_section(args, model_dir: Path, work: Path, env: dict, budget: Budget) -> dict | str:
    """T4A4 training runs sampling with vLLM (the preset's settings, 2 steps): one process; where two GPUs are
    visible also two processes with an engine each (TP 1) and with one engine of both (TP 2). Per run: exit
    code, whether a traceback was printed, step and rollout time, generated tokens/s (beside the T4A4 section's
    HF figure), the prefix-cache hit rate and the log-prob gap per process."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        print("  skipped: vLLM is not installed (scripts/setup.sh --vllm)", flush=True)
        return "skipped: no vLLM"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs/accelerate/ddp.yaml"), "--num_processes", "2"]
    launches = [("1 process", None, [])]
    if gpus >= 2:
        launches += [("2 GPUs, two engines (TP 1)", launcher, []), ("2 GPUs, one engine (TP 2)", launcher, ["rollout.vllm_tensor_parallel_size=2"])]
    else:
        print(f"  {gpus} GPU(s) visible: two engines and TP 2 need 2, skipped", flush=True)
    from vlm_grpo_ma.run.metrics import read_metrics

    results = {}
    for number, (label, run_launcher, extra) in enumerate(launches):
        run_dir = work / f"run-vllm-{number}"
        shutil.rmtree(run_dir, ignore_errors=True)
        command = train_command(args, model_dir, run_dir, launcher=run_launcher, steps=max(min(args.steps, 3), 2), engine="vllm") + extra
        print("  " + " ".join(command[1:]), flush=True)
        returncode, log_text = run_streaming(command, env, work / f"train-vllm-{number}.log", timeout=budget.left(), echo=False)
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        result = summarize_run(records, log_text)
        last = records[-1] if records else {}
        per_process = {key: value for key, value in last.items() if key.startswith("rollout/process")}
        result.update(exit_code=returncode, traceback="Traceback" in log_text, hit_rate=last.get("rollout/prefix_cache_hit_rate"), per_process=per_process)
        print(f"  {label}: exit code {returncode}, traceback {'yes' if result['traceback'] else 'no'}, {len(records)} steps;"
              f" step {_fmt(result['step_seconds'], '.2f', ' s')} (rollout {_fmt(result['rollout_seconds'], '.2f', ' s')}),"
              f" generated {_fmt(result['generated_tokens_per_second'], ',.0f', ' tokens/s')} a process,"
              f" hit rate {_fmt(result['hit_rate'], '.3f')}, log-prob gap max {_fmt(result['logprob_mismatch_max'], '.3g')}", flush=True)  # fmt: skip
        for key, value in sorted(per_process.items()):
            print(f"    {key} {value:.4g}", flush=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        results[label] = result
    return results


def split_figures(records: list[dict]) -> dict:
    """A split launch's own figures from its metrics.jsonl records: each step's staleness (``rollout/staleness_max``),
    the trainer's and the engine's idle seconds (means over the steps after the first, as ``summarize_run``'s), the
    log-prob gap max over the steps sampled with the trainer's current weights (staleness 0: the engine's numerical
    gap; a stale step's gap also holds the update's change), and the smallest answer-level importance ESS (logged
    where rollout.max_staleness > 0)."""
    steady = _steady(records)
    fresh_gaps = _numbers(r.get("rollout/logprob_gap_max") for r in records if r.get("rollout/staleness_max") == 0)
    return {
        "staleness_max": [r.get("rollout/staleness_max") for r in records],
        "trainer_idle_s": _mean([r.get("time/trainer_idle_s") for r in steady]),
        "engine_idle_s": _mean([r.get("time/engine_idle_s") for r in steady]),
        "logprob_gap_max_staleness_0": max(fresh_gaps, default=None),
        "importance_ess_answer_min": min(_numbers(r.get("rollout/importance_ess_answer") for r in records), default=None),
    }


def overlap_bound(result: dict) -> float | None:
    """The least S=1 / S=0 seconds per step can be, from an S=0 run's parts (as scripts/bench_split.py): its step is
    r + u (r: the trainer's wait for its trees, time/rollout_seconds; u: the rest, the update), overlapped at best
    max(r, u)."""
    rollout, step = result.get("rollout_seconds"), result.get("step_seconds")
    if rollout is None or not step:
        return None
    return max(rollout, step - rollout) / step


def split_command(args, model_dir: Path, run_dir: Path, launch: str, *, engine: str, gpus: int, steps: int) -> list[str]:
    """The trainer's command line for the split launch ``launch`` (a key of SPLIT_LAUNCHES): 2 processes, the last an
    engine process sampling with ``engine``."""
    accelerate_config = "ddp.yaml" if args.device == "cuda" else "cpu-2proc.yaml"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs/accelerate" / accelerate_config), "--num_processes", "2"]  # fmt: skip
    extra = [] if args.device == "cuda" else ["train.num_threads=1"]  # CPU: the two processes run at once, a thread each
    if engine == "vllm" and args.device == "cuda":
        extra.append("rollout.vllm_sleep=false")  # an engine process never sleeps (on the CPU train_command says so already)
        if gpus == 1:  # the trainer (LOCAL_RANK 0) and the engine process (the current device) share GPU 0
            extra.append(f"rollout.vllm_gpu_memory_utilization={SPLIT_SHARED_GPU_VLLM_SHARE}")
    return train_command(args, model_dir, run_dir, launcher=launcher, steps=steps, engine=engine) + SPLIT_LAUNCHES[launch] + extra


def split_section(args, model_dir: Path, work: Path, env: dict, budget: Budget, figures: dict) -> dict:
    """The T4A4 run as a split launch (issue 49: ``rollout.engine_processes=1``, the last of 2 processes only samples)
    at S=1 and S=0, with vLLM on a GPU where it is installed, else (and on the CPU) the HF engine. Per launch: exit
    code, traceback, staleness per step, s/step, the two sides' idle time, the log-prob gap at staleness 0 and the
    importance ESS; then S=1 / S=0 against the overlap's bound from the S=0 run, and S=1 against the ordinary launch
    of the same settings where an earlier section of this call ran it."""
    import importlib.util

    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device != "cuda":
        engine = "hf"
        print("  on the CPU: the HF engine (vLLM's CPU engine adds ~30 s to each launch)", flush=True)
    elif importlib.util.find_spec("vllm") is None:
        engine = "hf"
        print("  vLLM is not installed (scripts/setup.sh --vllm): the engine process samples with the HF engine", flush=True)
    else:
        engine = "vllm"
    if gpus == 1:
        share = f", vLLM's share {SPLIT_SHARED_GPU_VLLM_SHARE}" if engine == "vllm" else ""
        print(f"  1 GPU: the trainer and the engine process share it{share}", flush=True)
    steps = max(min(args.steps, 3), 2)
    from vlm_grpo_ma.run.metrics import read_metrics

    results = {}
    for launch in SPLIT_LAUNCHES:
        run_dir = work / f"run-split-{launch[-1]}"
        shutil.rmtree(run_dir, ignore_errors=True)
        command = split_command(args, model_dir, run_dir, launch, engine=engine, gpus=gpus, steps=steps)
        print("  " + " ".join(command[1:]), flush=True)
        returncode, log_text = run_streaming(command, env, work / f"train-split-{launch[-1]}.log", timeout=budget.left(), echo=False)
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        result = {**summarize_run(records, log_text), **split_figures(records), "engine": engine, "steps": steps}
        result.update(exit_code=returncode, traceback="Traceback" in log_text)
        print(f"  {launch}: exit code {returncode}, traceback {'yes' if result['traceback'] else 'no'}, {len(records)} of {steps} steps;"
              f" staleness max per step {' '.join(map(str, result['staleness_max'])) or 'n/a'};"
              f" {_fmt(result['step_seconds'], '.2f', ' s/step')} after step 1 (trainer's wait {_fmt(result['rollout_seconds'], '.2f', ' s')});"
              f" idle: trainer {_fmt(result['trainer_idle_s'], '.2f', ' s')}, engine {_fmt(result['engine_idle_s'], '.2f', ' s')};"
              f" log-prob gap max at staleness 0 {_fmt(result['logprob_gap_max_staleness_0'], '.3g')};"
              f" importance ESS (answer) min {_fmt(result['importance_ess_answer_min'], '.3f')}", flush=True)  # fmt: skip
        if returncode != 0:
            print(f"  the launch failed; its log: {work / f'train-split-{launch[-1]}.log'}", flush=True)
            args.keep = True
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        results[launch] = result
    overlapped, waiting = results["S=1"]["step_seconds"], results["S=0"]["step_seconds"]
    results["ratio"] = overlapped / waiting if overlapped and waiting else None
    results["bound"] = overlap_bound(results["S=0"])
    print(f"  S=1 / S=0 s/step {_fmt(results['ratio'], '.3f')}; bound max(r, u)/(r + u) from the S=0 run {_fmt(results['bound'], '.3f')}"
          f" (r = its trainer's wait {_fmt(results['S=0']['rollout_seconds'], '.2f', ' s')}, u = the rest of its step)", flush=True)  # fmt: skip
    if gpus <= 1:  # against one process of the same settings on the same device, where this call ran it
        section = "vllm" if engine == "vllm" else "T4A4"
        ordinary = figures.get(section)
        if engine == "vllm" and isinstance(ordinary, dict):
            ordinary = ordinary.get("1 process")
        # a run of one step has only its warm-up step to give
        alone = ordinary.get("step_seconds") if isinstance(ordinary, dict) and ordinary.get("steps_logged", 0) > 1 else None
        results["ratio_to_one_process"] = overlapped / alone if overlapped and alone else None
        print(f"  S=1 / one process (section {section}) s/step {_fmt(results['ratio_to_one_process'], '.3f')}"
              f"{'' if alone else ' (that section did not run more than one step in this call)'}", flush=True)  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
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
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks CUDA whenever it sees it
    # On a CPU self-check the H200 estimates mean nothing: every section gets a token estimate
    estimates = H200_ESTIMATES if args.size == "3b" else {k: 1.0 for k in H200_ESTIMATES}
    budget = Budget(args.budget_s, estimates, {"model", *args.sections})

    header(1, "plan")
    print(f"  {environment_line(args.device)}")
    for note in unwired_notes():
        print(f"  note: {note}")
    run = RUN_DEFAULTS[args.size]
    print(f"  Qwen2.5-VL {args.size} architecture, random weights, {args.prompts_per_step or run['prompts_per_step']} prompts/step, "
          f"thoughts <= {args.max_thought_tokens or run['max_thought_tokens']} tokens, answers <= "
          f"{args.max_answer_tokens or run['max_answer_tokens']}, {args.steps} steps per run; "
          f"{visual_tokens(168, SPECS[args.size]['image_pixels'])}")  # fmt: skip
    print(f"  budget {args.budget_s:.0f} s; estimated seconds on one H200 at the 3B size (a section that does not fit in what is left is skipped):")
    for key, title in SECTIONS.items():
        print(f"    {title:<55} {H200_ESTIMATES[key]:>4} s")
    print(f"    {'total':<55} {sum(H200_ESTIMATES.values()):>4} s", flush=True)

    if args.work_dir is not None:
        args.keep = True  # never delete a folder the caller named
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    figures: dict = {"size": args.size, "device": args.device, "lora": args.lora, "steps": args.steps}
    failed = False
    try:
        header(2, SECTIONS["model"])
        if not budget.allows("model"):
            return 1  # nothing else can run without the model
        t0 = time.perf_counter()
        params = save_model_folder(model_dir, args.size, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32")
        figures["parameters"] = params
        print(f"  built and saved a random {args.size} Qwen2.5-VL ({params / 1e9:.3f}B parameters) in "
              f"{time.perf_counter() - t0:.1f} s -> {model_dir}", flush=True)  # fmt: skip
        if args.device == "cuda":
            torch.cuda.empty_cache()
        for number, (key, thoughts, answers) in enumerate((("T4A4", 4, 4), ("T16A1", 16, 1)), start=3):
            header(number, SECTIONS[key])
            if budget.allows(key):
                figures[key] = training_section(args, key, model_dir, work, env, budget, thoughts, answers)
                failed |= figures[key]["trainer_exit_code"] != 0 or figures[key]["steps_logged"] < args.steps
        header(5, SECTIONS["forward"])
        if budget.allows("forward"):
            figures["forward"] = forward_section(args, model_dir, budget)
        header(6, SECTIONS["fsdp"])
        if budget.allows("fsdp"):
            figures["fsdp"] = fsdp_section(args, model_dir, work, env, budget)
        header(7, SECTIONS["decode"])
        if budget.allows("decode"):
            figures["decode"] = decode_section(args, work, env, budget)
        header(8, SECTIONS["engines"])
        if budget.allows("engines"):
            figures["engines"] = engines_section(args, model_dir, work, env, budget)
        header(9, SECTIONS["vllm"])
        if budget.allows("vllm"):
            figures["vllm"] = vllm_section(args, model_dir, work, env, budget)
            failed |= isinstance(figures["vllm"], dict) and any(r["exit_code"] != 0 or r["traceback"] for r in figures["vllm"].values())
        header(10, SECTIONS["split"])
        if budget.allows("split"):
            figures["split"] = split_section(args, model_dir, work, env, budget, figures)
            failed |= any(r["exit_code"] != 0 or r["traceback"] or r["steps_logged"] < r["steps"] for r in map(figures["split"].get, SPLIT_LAUNCHES))
        header(11, "summary")
        for key in ("T4A4", "T16A1"):
            r = figures.get(key)
            if isinstance(r, dict):
                print(f"  {key:<6} step {_fmt(r['step_seconds'], '.2f', ' s')}, generated {_fmt(r['generated_tokens_per_second'], ',.0f', ' tok/s')}, "
                      f"trained {_fmt(r['trained_tokens_per_second'], ',.0f', ' tok/s')}, MFU {_fmt(None if r['mfu'] is None else 100 * r['mfu'], '.1f', '%')}, "
                      f"peak {_fmt(r['peak_gpu_memory_gb'], '.1f', ' GiB')}")  # fmt: skip
            else:
                print(f"  {key:<6} not run")
        hf_generated = (figures.get("T4A4") or {}).get("generated_tokens_per_second")
        for label, r in (figures.get("vllm") if isinstance(figures.get("vllm"), dict) else {}).items():
            print(f"  vllm, {label}: step {_fmt(r['step_seconds'], '.2f', ' s')}, generated {_fmt(r['generated_tokens_per_second'], ',.0f', ' tok/s')}"
                  f" a process (hf T4A4: {_fmt(hf_generated, ',.0f', ' tok/s')}), hit rate {_fmt(r['hit_rate'], '.3f')}")  # fmt: skip
        for attention, out in (figures.get("forward") or {}).items():
            text = out if isinstance(out, str) else f"ratio {out['ratio']:.2f}x, log-prob max difference {out['logprob_max_abs_diff']:.2e}"
            print(f"  forward, {attention}: {text}")
        if isinstance(figures.get("split"), dict):
            r = figures["split"]
            print(f"  split ({r['S=1']['engine']} engine): S=1 {_fmt(r['S=1']['step_seconds'], '.2f', ' s/step')}, S=0 "
                  f"{_fmt(r['S=0']['step_seconds'], '.2f', ' s/step')}, ratio {_fmt(r['ratio'], '.3f')} (bound {_fmt(r['bound'], '.3f')})")  # fmt: skip
        print(f"  wall time {time.perf_counter() - budget.started:.0f} s of the {args.budget_s:.0f} s budget", flush=True)
        figures["total_seconds"] = time.perf_counter() - budget.started
        if args.summary_json:
            args.summary_json.parent.mkdir(parents=True, exist_ok=True)
            args.summary_json.write_text(json.dumps(figures, indent=2, default=str))
        return 1 if failed else 0
    finally:
        if args.keep:
            print(f"[gpu_check] kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
