"""``python -m vlm_grpo_ma.bench rollout --engine hf,vllm``: the rollout engines (``rollout.engine``) side by side.

Each engine samples the trainer's K x M tree (``engine.sample``, as ``loop.sample_step`` calls it) from the same
prompts with the same settings, in one process, repeats alternating (hf, vllm, hf, vllm, ...) so that load on
the machine falls on both. Reported per engine and model: median seconds per tree, mean generated tokens per
tree (an untrained model decodes to the limits, a trained one stops where it stops: compare seconds with the
tokens beside them), and vLLM's prefix-cache hit rate (hit tokens / queried tokens of the tree). The vLLM engine
is started from the model's folder and then given the policy's weights, as a run starts it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from vlm_grpo_ma.engines import ENGINES
from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
from vlm_grpo_ma.model.loading import Policy


def make_bench_engine(name: str, policy: Policy, seed: int):
    if name == "hf":
        from vlm_grpo_ma.engines.hf import HFEngine

        return HFEngine()
    from vlm_grpo_ma.engines.vllm import VLLMEngine, check_vllm

    check_vllm(1)
    engine = VLLMEngine(
        policy.model.name_or_path, dtype=str(policy.model.dtype).removeprefix("torch."), seed=seed,
        max_pixels=policy.processor.image_processor.size["longest_edge"],
    )  # fmt: skip
    engine.push_weights(policy)
    return engine


def bench_engines(policy: Policy, samples, prompts, engine_names: list[str], tree) -> dict:
    """Median seconds, generated tokens and hit rate of each engine's K x M tree over ``tree.repeats`` rounds."""
    engines = {name: make_bench_engine(name, policy, tree.seed) for name in engine_names}
    seconds = {name: [] for name in engines}
    tokens = {name: [] for name in engines}
    hit_rate = {name: [] for name in engines}
    for round_index in range(tree.warmup + tree.repeats):
        for name, engine in engines.items():
            settings = SamplingSettings(
                temperature=1.0, max_thought_tokens=tree.max_thought_tokens, max_answer_tokens=tree.max_answer_tokens,
                generators=prompt_generators(tree.seed + round_index, 0, len(prompts)),
            )  # fmt: skip
            engine.step_metrics()  # counters from here on are this tree's
            started = time.perf_counter()
            with torch.no_grad():
                rollout = engine.sample(policy, samples, prompts, num_thoughts=tree.num_thoughts,
                                        num_answers=tree.num_answers, settings=settings)  # fmt: skip
            elapsed = time.perf_counter() - started
            if round_index < tree.warmup:
                continue
            seconds[name].append(elapsed)
            tokens[name].append(sum(map(len, rollout.tree.thought_ids)) + sum(map(len, rollout.tree.answer_ids)))
            hit_rate[name].append(engine.step_metrics().get("rollout/prefix_cache_hit_rate", float("nan")))
    return {
        name: {
            "seconds_per_tree": statistics.median(seconds[name]),
            "generated_tokens": statistics.mean(tokens[name]),
            "prefix_cache_hit_rate": statistics.mean(hit_rate[name]),
        }
        for name in engines
    }


def engines_main(args: argparse.Namespace) -> list[dict]:
    from vlm_grpo_ma.tools.bench_inputs import (
        EMBEDDED,
        bench_samples,
        check_models,
        each_model,
        load_average,
        shared_settings,
        write_results,
    )

    engine_names = [name.strip() for name in args.engine.split(",") if name.strip()]
    unknown = [name for name in engine_names if name not in ENGINES]
    if unknown or not engine_names:
        raise SystemExit(f"unknown engine(s) {unknown or args.engine!r}; choose from: {', '.join(ENGINES)}")
    names = check_models(args)
    tree = shared_settings(args)
    print(
        f"rollout engines: {', '.join(engine_names)}; B={args.prompts} K={args.thoughts} M={args.answers} "
        f"thought<={args.thought_tokens} answer<={args.answer_tokens} tok, repeats={args.repeats} (+{args.warmup} "
        f"warm-up), alternating, seed={args.seed}; load average before: {load_average()}",
        flush=True,
    )

    def measure(name: str, policy: Policy, prompts) -> dict:
        samples = bench_samples(args.prompts, image_size=args.image_size)
        result = {"engines": bench_engines(policy, samples, prompts, engine_names, tree)}
        result["weights"] = "warm-started" if name == EMBEDDED else "untrained"
        result["params"] = sum(p.numel() for p in policy.model.parameters())
        return result

    rows = each_model(names, args, measure)
    print()
    print(format_engines_table(rows, engine_names))
    print(f"load average after: {load_average()} (wall times on a shared machine; compare engines within a row)")
    write_results(Path(args.out) if args.out else None, "rollout_engines", rows)
    return rows


def format_engines_table(rows: list[dict], engine_names: list[str]) -> str:
    header = f"{'model':<11} {'params':>8} | " + " | ".join(f"{name + ' s/tree':>12} {'tokens':>7} {'hit rate':>8}" for name in engine_names)
    if len(engine_names) == 2:
        header += f" | {engine_names[0]}/{engine_names[1]}"
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = [
            f"{row['engines'][n]['seconds_per_tree']:>12.3f} {row['engines'][n]['generated_tokens']:>7.0f} "
            + (f"{rate:>8.2f}" if (rate := row["engines"][n]["prefix_cache_hit_rate"]) == rate else f"{'-':>8}")
            for n in engine_names
        ]
        line = f"{row['model']:<11} {row['params'] / 1e6:>7.2f}M | " + " | ".join(cells)
        if len(engine_names) == 2:
            a, b = (row["engines"][n]["seconds_per_tree"] for n in engine_names)
            line += f" | {a / b:>5.2f}x"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m vlm_grpo_ma.tools.bench_engines MODEL_DIR``: the engines on one model folder (scripts/gpu_check.py's
    'engines' section runs it on the random 3B model): bf16 on a GPU, fp32 on the CPU."""
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.model.prompts import encode_prompt
    from vlm_grpo_ma.task_api.registry import get_task
    from vlm_grpo_ma.tools.bench_inputs import BenchTree, bench_samples

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine", default="hf,vllm")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--thought-tokens", type=int, default=40)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--max-pixels", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    policy = load_policy(args.model_dir, dtype=dtype, max_pixels=args.max_pixels, min_pixels=args.max_pixels, device=args.device)
    policy.model.eval()
    samples = bench_samples(args.prompts)
    prompts = [encode_prompt(policy, s, get_task("grounding").instruction) for s in samples]
    names = [n.strip() for n in args.engine.split(",") if n.strip()]
    tree = BenchTree(max_thought_tokens=args.thought_tokens, max_answer_tokens=args.answer_tokens, repeats=args.repeats)
    row = {"model": Path(args.model_dir).name, "params": sum(p.numel() for p in policy.model.parameters())}
    row["engines"] = bench_engines(policy, samples, prompts, names, tree)
    print(format_engines_table([row], names), flush=True)


if __name__ == "__main__":
    main()
