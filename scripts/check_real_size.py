"""The published architectures, run once: two GRPO-MA steps of the LoRA preset's code path, a checkpoint and a
resume, at Qwen2.5-VL-3B's, Qwen2-VL-2B's and Qwen3-VL-4B's real sizes on this CPU, random weights in bf16.

    .venv/bin/python scripts/check_real_size.py                          # the three families, one after another
    .venv/bin/python scripts/check_real_size.py --models qwen3-vl-2b     # any of vlm_grpo_ma.model.architectures.ARCHITECTURES
    .venv/bin/python scripts/check_real_size.py --models qwen3.5-2b qwen3.5-4b   # Qwen3.5's hybrid (Gated DeltaNet) sizes
    .venv/bin/python scripts/check_real_size.py --shrunk                 # the same path on shrunk copies (seconds)
    .venv/bin/python scripts/check_real_size.py --gradient-checkpointing # the preset's checkpointed update

For each model, one at a time (a 3B-4B model in bf16 takes 8-9 GB of host memory):
1. builds it from ``vlm_grpo_ma.model.architectures`` (the published config.json numbers: every width and depth, the
   vision tower's window/full-attention blocks or deepstack layers, tied embeddings, the 151,936-token
   vocabulary (Qwen3.5: 248,320, and its 3:1 Gated DeltaNet / full-attention layers), the M-RoPE sections),
   random weights allocated directly in bf16, and prints its parameter count against the published one (for
   Qwen3.5 the hub's figure includes the checkpoint's multi-token-prediction head, which transformers does not
   build: the built model plus that head's hand count is compared); saves it with the family's real processor around the project's tiny
   tokenizer (its ids fit in the real vocabulary), images resized to ~448 x 448 px;
2. runs ``python -m vlm_grpo_ma.train`` on it with ``configs/qwen2.5-vl-3b-lora-grounding-t4a4.yaml``
   (LoRA rank 64 on every projection, frozen vision tower, bf16 weights and autocast), overriding only what
   keeps it to minutes on two CPU cores: 2 steps of 1 prompt (an embedded scene upscaled to 448 px),
   K = 2 x M = 2, thoughts <= 8 tokens, answers <= 4, and gradient checkpointing off (the tree-shared
   training forward: each prompt encoded once instead of K x M times; ``--gradient-checkpointing`` keeps
   the preset's, ~5x the compute); the trainer saves the LoRA checkpoint after step 2;
3. resumes that run (``--resume``) for a third step;
4. prints per run: exit code, step times (from metrics.jsonl), and the trainer process's peak RSS (the
   kernel's ru_maxrss of that child); next to it the memory model's prediction for the same config on one
   process (``vlm_grpo_ma.run.memory_model``) plus the measured RSS of a process that only imports the trainer (Python,
   torch, transformers), and whether they agree within 20%.

Exit status 0 when every run finished its steps, the resume continued at step 3, every parameter count
matches its published figure, and every prediction is within 20% of the measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from vlm_grpo_ma.model import architectures  # noqa: E402

PRESET = REPO / "configs" / "qwen2.5-vl-3b-lora-grounding-t4a4.yaml"
DEFAULT_MODELS = ("qwen2.5-vl-3b", "qwen2-vl-2b", "qwen3-vl-4b")
IMAGE_SIDE = 448  # px: min = max pixels = 448 x 448, so the 168 px embedded scenes are upscaled to it
TOLERANCE = 0.20  # the memory model against the measured peak RSS
PUBLISHED_ROUNDED = 0.005  # a published count rounded to 10M parameters: compared to 0.5%


def overrides(model_dir: Path, steps: int, checkpointing: bool = False, hybrid: bool = False) -> list[str]:
    """The preset's settings, made to fit a CPU: the token limits, K x M, the batch and the engine (hf) are the
    only changes, and gradient checkpointing unless ``checkpointing``. A ``hybrid`` model (Qwen3.5) also gets
    adapters on its linear-attention projections, as a user training it would name them."""
    pixels = IMAGE_SIDE * IMAGE_SIDE
    if hybrid:
        from vlm_grpo_ma.model.lora import LINEAR_ATTENTION_TARGETS
        from vlm_grpo_ma.run.config_files import load_config

        targets = [*load_config(str(PRESET)).model.lora_target_modules, *LINEAR_ATTENTION_TARGETS]
        extra = [f"model.lora_target_modules=[{','.join(targets)}]"]
    else:
        extra = []
    return [*extra,
        f"model.name_or_path={model_dir}",
        "data.task=grounding",
        "data.source=null",  # the embedded scenes
        f"train.steps={steps}",
        "train.prompts_per_step=1",
        "train.micro_batch_rows=4",
        # by default the tree-shared training forward (each prompt and thought encoded once): ~5x less compute
        # here than re-encoding every row under the preset's gradient checkpointing (--gradient-checkpointing)
        f"model.gradient_checkpointing={str(checkpointing).lower()}",
        # the trainer's own sampler: the memory model counts its KV cache (the one-GPU presets name vLLM,
        # whose engine holds a second copy of the weights and a KV cache of its own size)
        "rollout.engine=hf",
        "rollout.num_thoughts=2",
        "rollout.num_answers=2",
        "rollout.max_thought_tokens=8",
        "rollout.max_answer_tokens=4",
        f"model.min_pixels={pixels}",
        f"model.max_pixels={pixels}",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1",
        "train.eval_every=0",
        "logging.report_to=[]",
        "logging.progress_bar=false",
        "logging.rollout_samples_per_step=1",
    ]


def run_child(command: list[str], env: dict, log_path: Path) -> tuple[int, float, float]:
    """Run ``command`` from the repository root, its output into ``log_path``; returns (exit code, wall
    seconds, peak RSS in bytes of that child, from the kernel's accounting of it)."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - started, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def build_folder(arch: architectures.Architecture, out_dir: Path) -> tuple[int, float]:
    """Build ``arch`` with random bf16 weights and save it with its processor; (parameters, seconds)."""
    from transformers import AutoTokenizer

    from vlm_grpo_ma.model.tiny import TINY_MODEL_DIR

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    pixels = IMAGE_SIDE * IMAGE_SIDE
    processor = architectures.build_processor(arch, tokenizer, min_pixels=pixels, max_pixels=pixels)
    model = architectures.build_model(architectures.build_config(arch, tokenizer), dtype="bfloat16")
    params = architectures.count_parameters(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    del model
    return params, time.perf_counter() - started


def published_line(arch: architectures.Architecture, params: int) -> tuple[str, bool]:
    counts = architectures.parameter_counts(arch)
    counted = counts.total
    if arch.published_parameters is None:
        return f"{params:,} parameters (shrunk copy; hand count {counted:,})", params == counted
    if arch.published_exact:
        ok = params == arch.published_parameters == counted
        return f"{params:,} parameters; published {arch.published_parameters:,} ({'equal' if ok else 'DIFFERENT'})", ok
    checkpoint = params + counts.mtp  # the hub counts the checkpoint's MTP head (Qwen3.5), which is not built
    ok = params == counted and abs(checkpoint - arch.published_parameters) <= PUBLISHED_ROUNDED * arch.published_parameters
    mtp = f" + {counts.mtp:,} of the checkpoint's MTP head, not loaded = {checkpoint:,}" if counts.mtp else ""
    return (
        f"{params:,} parameters{mtp}; published {arch.published_parameters / 1e9:.2f}B (the hub's rounded figure; "
        f"{'within' if ok else 'NOT within'} 0.5%)",
        ok,
    )


def is_hybrid(arch: architectures.Architecture) -> bool:
    """Linear-attention layers (Qwen3.5)."""
    return architectures.LINEAR_ATTENTION in architectures.layer_types(arch.text)


def predicted_bytes(arch: architectures.Architecture, model_dir: Path, checkpointing: bool) -> int:
    from vlm_grpo_ma.run.config_files import load_config
    from vlm_grpo_ma.run.memory_model import estimate

    cfg = load_config(str(PRESET), overrides(model_dir, 2, checkpointing, is_hybrid(arch)))
    return estimate(arch, cfg, processes=1, strategy="ddp").peak


def step_figures(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(int(r["step"]), float(r["time/step_seconds"])) for r in records if "time/step_seconds" in r]


def check_model(name: str, arch: architectures.Architecture, work: Path, env: dict, baseline_rss: float, shrunk: bool, reuse: bool, keep: bool, checkpointing: bool) -> bool:
    print(f"\n== {name}: {arch.hub_id} ({arch.family}) ==", flush=True)
    model_dir, run_dir = work / f"{name}-model", work / f"{name}-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    # built in a process of its own: its memory is returned before the trainer starts
    build = [sys.executable, str(Path(__file__).resolve()), "--build", name, str(model_dir)] + (["--shrunk"] if shrunk else [])
    if reuse and (model_dir / "parameters.txt").exists():  # a model this script built and saved before
        code, seconds, build_rss = 0, 0.0, 0.0
    else:
        code, seconds, build_rss = run_child(build, env, work / f"{name}-build.log")
    if code != 0:
        print(f"  building failed; log: {work / f'{name}-build.log'}", flush=True)
        return False
    params = int((model_dir / "parameters.txt").read_text())
    line, ok = published_line(arch, params)
    built = f"built in bf16 and saved in {seconds:.0f} s (peak RSS {build_rss / 1e9:.2f} GB)" if build_rss else "reused"
    print(f"  {built}: {line}", flush=True)
    predicted = predicted_bytes(arch, model_dir, checkpointing)
    train = [sys.executable, "-m", "vlm_grpo_ma.train", "--config", str(PRESET), "--output-dir", str(run_dir)]
    # the first run logs steps 1 and 2 and saves; the resumed one logs step 3 only (a restart would log 1-3)
    runs = [
        ("2 steps + checkpoint", train + overrides(model_dir, 2, checkpointing, is_hybrid(arch)), [1, 2]),
        ("resume, step 3", train + ["--resume"] + overrides(model_dir, 3, checkpointing, is_hybrid(arch)), [3]),
    ]
    for title, command, expected_steps in runs:
        logged_before = len(step_figures(run_dir))
        log_path = work / f"{name}-{expected_steps[-1]}.log"
        code, wall, rss = run_child(command, env, log_path)
        steps = step_figures(run_dir)[logged_before:]  # the steps this run logged
        finished = code == 0 and [s for s, _ in steps] == expected_steps
        times = ", ".join(f"step {s}: {t:.1f} s" for s, t in steps)
        expected = baseline_rss + predicted
        agree = abs(expected - rss) <= TOLERANCE * rss
        print(
            f"  {title}: exit code {code}, {wall:.0f} s wall; {times or 'no steps logged'}\n"
            f"    peak RSS {rss / 1e9:.2f} GB measured; predicted {expected / 1e9:.2f} GB = memory model "
            f"{predicted / 1e9:.2f} GB + runtime {baseline_rss / 1e9:.2f} GB "
            f"({(expected - rss) / rss:+.1%}: {'within' if agree else 'NOT within'} {TOLERANCE:.0%})",
            flush=True,
        )
        if not finished:
            print(f"    did not log steps {expected_steps}; log: {log_path}", flush=True)
        ok = ok and bool(finished) and agree
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*")) if (run_dir / "checkpoints").exists() else []
    print(f"  checkpoints: {', '.join(checkpoints) or 'none'}", flush=True)
    if not keep:
        shutil.rmtree(model_dir, ignore_errors=True)  # 4-9 GB of disk each
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph: a whole sentence
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help=f"keys of ARCHITECTURES (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--shrunk", action="store_true", help="shrunk copies of the same families (the script's own check, seconds)")
    parser.add_argument("--work-dir", type=Path, help="where the models, runs and logs go (kept); default: a temporary folder, removed")
    parser.add_argument("--reuse-models", action="store_true", help="with --work-dir: use the model folders an earlier run left there")
    parser.add_argument("--keep-models", action="store_true", help="keep each model folder (4-9 GB) after its runs")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="the preset's gradient checkpointing (rows re-encoded: ~5x the compute)")
    parser.add_argument("--build", nargs=2, metavar=("MODEL", "DIR"), help=argparse.SUPPRESS)  # the builder child
    args = parser.parse_args(argv)
    if args.build:
        arch = architectures.ARCHITECTURES[args.build[0]]
        params, _ = build_folder(architectures.shrunk(arch) if args.shrunk else arch, Path(args.build[1]))
        (Path(args.build[1]) / "parameters.txt").write_text(str(params))  # written last: the folder is complete
        return 0
    unknown = [m for m in args.models if m not in architectures.ARCHITECTURES]
    if unknown:
        parser.error(f"unknown models {unknown}; valid: {', '.join(architectures.ARCHITECTURES)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="check_real_size-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU", flush=True)
        # what a trainer process holds before any model: Python, torch, transformers, the project
        code, _, baseline = run_child([sys.executable, "-c", "import vlm_grpo_ma.train, peft"], env, work / "runtime.log")
        if code != 0:
            print(f"importing the trainer failed; log: {work / 'runtime.log'}")
            return 1
        print(f"runtime RSS (a process that only imports the trainer): {baseline / 1e9:.2f} GB", flush=True)
        ok = True
        for name in args.models:
            arch = architectures.ARCHITECTURES[name]
            ok &= check_model(name, architectures.shrunk(arch) if args.shrunk else arch, work, env, baseline, args.shrunk, args.reuse_models, args.keep_models, args.gradient_checkpointing)
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"\nthis script's own peak RSS (building the models): {own / 1e9:.2f} GB", flush=True)
        print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
        return 0 if ok else 1
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
