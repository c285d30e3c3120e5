"""``python -m vlm_grpo_ma.memory``: the memory model (``run/memory_model.py``) of a preset, per GPU.

    python -m vlm_grpo_ma.memory --config configs/qwen2.5-vl-3b-lora-grounding-t4a4.yaml --processes 8 [--strategy fsdp] [--gpu-gb 80]
    python -m vlm_grpo_ma.memory --config PRESET --videos-per-prompt 1   # data with a video per sample
    python -m vlm_grpo_ma.memory --config PRESET --processes 8 --engine-processes 2   # a split launch: 6 trainers, 2 engines
    python -m vlm_grpo_ma.memory --all      # every preset on 1 and 8 GPUs of 80 and 141 GB
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlm_grpo_ma.model.architectures import Architecture, architecture_of, parameter_counts
from vlm_grpo_ma.run.config import Config, ConfigError
from vlm_grpo_ma.run.config_files import load_config
from vlm_grpo_ma.run.memory_model import GPU_SIZES_GB, PARTS, STRATEGIES, estimate, verdict, video_tokens
from vlm_grpo_ma.run.split_launch import check_split

REPO = Path(__file__).resolve().parents[2]


def preset_paths() -> list[Path]:
    return sorted((REPO / "configs").glob("*.yaml"))


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}"


def report(
    arch: Architecture, cfg: Config, processes: int, strategy: str, gpu_gb: float, videos_per_prompt: int = 0, tool_images: int = 0,
    role: str = "both",
) -> str:  # fmt: skip
    """The table of one process of ``role`` (``memory_model.estimate``'s) among ``processes`` of that role."""
    e = estimate(arch, cfg, processes, strategy, device_bytes=int(gpu_gb * 1e9), videos_per_prompt=videos_per_prompt,
                 tool_images_per_thought=tool_images, role=role)  # fmt: skip
    if role == "engine":
        what = f"{processes} engine process(es), each sampling {cfg.train.prompts_per_step // processes} prompt(s) per step, training nothing"
    else:
        what = f"{processes} {'trainer ' if role == 'trainer' else ''}process(es), {strategy}, {e.micro_batches_per_process} micro-batch(es) per process and step"
    lines = [f"{cfg.model.name_or_path}: {parameter_counts(arch).total:,} parameters, {e.trained_elements:,} trained; {what}"]
    if videos_per_prompt:
        per_video = video_tokens(arch, cfg.model.video_max_frames, cfg.model.video_max_pixels)
        lines.append(f"{videos_per_prompt} video(s) per prompt, {per_video:,} tokens each (model.video_max_frames="
                     f"{cfg.model.video_max_frames}, model.video_max_pixels={cfg.model.video_max_pixels})")  # fmt: skip
    lines.append("predicted bytes per GPU (GB = 1e9 bytes):")
    for part in PARTS:
        lines.append(f"  {part:<12} {getattr(e, part):>16,}  ({_gb(getattr(e, part))} GB)")
    if e.recurrent_states:
        lines.append(f"  {'of which':<12} {e.recurrent_states:>16,}  ({_gb(e.recurrent_states)} GB: the Gated DeltaNet layers' conv and"
                     " recurrent states, fixed per row)")  # fmt: skip
    if e.fsdp_rollout_gather:
        lines.append(f"  {'fsdp gather':<12} {e.fsdp_rollout_gather:>16,}  ({_gb(e.fsdp_rollout_gather)} GB, the rollout's gathered weights)")
    if e.engine:
        sleeps = "frees it for the update (vllm_sleep)" if not e.engine_in_update else "holds it through the update"
        sleeps = "an engine process has no update" if role == "engine" else sleeps
        lines.append(f"  {'vllm engine':<12} {e.engine:>16,}  ({_gb(e.engine)} GB: {cfg.rollout.vllm_gpu_memory_utilization:g} of the GPU,"
                     f" its weights {_gb(e.engine_weights)} GB, the rest its KV cache; {sleeps})")  # fmt: skip
        lines.append(f"  {'weight push':<12} {e.push_transient:>16,}  ({_gb(e.push_transient)} GB: the largest tensor's fp32 copy and cast)")
        lines.append(f"  rollout peak {e.rollout_peak:>16,}  ({_gb(e.rollout_peak)} GB: weights + optimizer + reference + vllm engine + weight push)")
        lines.append(f"  update peak  {e.update_peak:>16,}  ({_gb(e.update_peak)} GB: weights + optimizer + reference + gradients + activations"
                     f"{' + vllm engine' if e.engine_in_update else ''})")  # fmt: skip
    else:
        lines.append(f"  rollout peak {e.rollout_peak:>16,}  ({_gb(e.rollout_peak)} GB: weights + optimizer + reference + KV cache)")
        lines.append(f"  update peak  {e.update_peak:>16,}  ({_gb(e.update_peak)} GB: weights + optimizer + reference + gradients + activations)")
    lines.append(f"  peak         {e.peak:>16,}  ({_gb(e.peak)} GB): {fit(e, gpu_gb)} in {gpu_gb:g} GB (CUDA context and allocator slack not counted)")
    return "\n".join(lines)


def fit(e, gpu_gb: float) -> str:
    """``verdict`` of the peak, or why the vLLM engine cannot start in its share."""
    if e.engine and e.engine <= e.engine_weights:
        return "no (the vLLM share holds not even the engine's weights: raise rollout.vllm_gpu_memory_utilization)"
    return verdict(e.peak, gpu_gb)


def table() -> str:
    """Every preset: predicted peak GB per GPU on 1 GPU, 8 GPUs DDP and 8 GPUs FSDP, and whether it fits in
    80 and 141 GB (a preset sampling with vLLM: its engine's share of each GPU size counted, two peaks)."""
    header = "| preset | model | 1 GPU | 8 GPUs, DDP | 8 GPUs, FSDP |"
    lines = [header, "|---|---|---|---|---|"]
    for path in preset_paths():
        cfg = load_config(str(path), [])
        arch = architecture_of(cfg.model.name_or_path)
        cells = []
        for processes, strategy in ((1, "ddp"), (8, "ddp"), (8, "fsdp")):
            if cfg.train.prompts_per_step % processes:
                cells.append(f"n/a ({cfg.train.prompts_per_step} prompts/step)")
                continue
            estimates = {gb: estimate(arch, cfg, processes, strategy, device_bytes=int(gb * 1e9)) for gb in GPU_SIZES_GB}
            if cfg.rollout.engine == "vllm":
                cells.append(", ".join(f"{gb} GB: {_gb(e.peak)} {fit(e, gb)}" for gb, e in estimates.items()))
                continue
            peak = estimates[GPU_SIZES_GB[0]].peak
            fits = ", ".join(f"{gb} GB: {fit(e, gb)}" for gb, e in estimates.items())
            cells.append(f"{_gb(peak)} GB ({fits})")
        lines.append(f"| {path.name} | {cfg.model.name_or_path} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_grpo_ma.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a preset (YAML)")
    parser.add_argument("--processes", type=int, default=1, help="GPUs (processes) the step is shared by (default 1)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="ddp: every GPU holds the model; fsdp: sharded")
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory to compare the peak with (default 80)")
    parser.add_argument("--all", action="store_true", help="a table of every preset on 1 and 8 GPUs of 80 and 141 GB")
    parser.add_argument("--tool-images", type=int, default=0,
                        help="crops a thought may get back (rollout.max_turns, for a task with tools such as zoom; default 0)")
    parser.add_argument("--videos-per-prompt", type=int, default=0,
                        help="the most videos a sample of the data holds, each counted at the model.video_* budget (default 0)")
    parser.add_argument("--engine-processes", type=int, default=None,
                        help="a split launch (rollout.engine_processes, which it sets): the last N of --processes only sample;"
                             " prints the trainers' and the engines' tables (default: the config's, 0)")
    parser.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    args = parser.parse_args(argv)
    if args.all:
        print(table())
        return 0
    if not args.config:
        parser.error("give --config PRESET, or --all")
    try:
        if args.tool_images < 0:
            raise ValueError(f"--tool-images={args.tool_images} must be >= 0")
        if args.videos_per_prompt < 0:
            raise ValueError(f"--videos-per-prompt={args.videos_per_prompt} must be >= 0")
        if args.engine_processes is not None and args.engine_processes < 0:
            raise ValueError(f"--engine-processes={args.engine_processes} must be >= 0")
        split = [] if args.engine_processes is None else [f"rollout.engine_processes={args.engine_processes}"]
        cfg = load_config(args.config, [*args.overrides, *split])
        arch = architecture_of(cfg.model.name_or_path)
        engines = cfg.rollout.engine_processes
        if engines and engines >= args.processes:
            raise ValueError(f"--engine-processes={engines} leaves no trainer among --processes={args.processes}: --processes counts the"
                             " launch's processes, trainers and engines; give more processes or fewer engine processes")  # fmt: skip
        if engines:
            check_split(cfg, args.processes)
            trainers = args.processes - engines
            text = (f"trainer processes: the first {trainers} of {args.processes} ({args.strategy} among them)\n"
                    + report(arch, cfg, trainers, args.strategy, args.gpu_gb, args.videos_per_prompt, args.tool_images, role="trainer")
                    + f"\n\nengine processes: the last {engines} of {args.processes} (rollout.engine_processes)\n"
                    + report(arch, cfg, engines, args.strategy, args.gpu_gb, args.videos_per_prompt, args.tool_images, role="engine"))  # fmt: skip
        else:
            text = report(arch, cfg, args.processes, args.strategy, args.gpu_gb, args.videos_per_prompt, args.tool_images)
    except (ConfigError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(text)
    return 0
