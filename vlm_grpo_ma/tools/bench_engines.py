"""``python -m vlm_grpo_ma.bench rollout --engine hf,vllm``: the rollout engines (``rollout.engine``) side by side.

Each engine samples the trainer's K x M tree (``engine.sample``, as ``loop.sample_step`` calls it) from the same
prompts with the same settings, in one process, repeats alternating (hf, vllm, hf, vllm, ...) so that load on
the machine falls on both. Reported per engine and model: median seconds per tree, mean generated tokens per
tree (an untrained model decodes to the limits, a trained one stops where it stops: compare seconds with the
tokens beside them), vLLM's prefix-cache hit rate (hit tokens / queried tokens of the tree), the prompt tokens
each engine prefilled for the tree (the HF engine: each prompt once; vLLM: the queried tokens that missed), and the
log-prob gap of the engine's sampled tokens against the trainer's forward of the same tokens in the same dtype
(what a run logs as ``rollout/logprob_gap_max`` / ``_mean``). The vLLM engine is started from the model's folder
and then given the policy's weights, as a run starts it; its prefix and encoder caches are emptied before each
tree, as a run's weight push empties them every step.

``python -m vlm_grpo_ma.tools.bench_engines tiny-qwen3.5`` runs it on a tiny random Qwen3.5 (``build_tiny_qwen3_5``)
in bfloat16 (vLLM's CPU Gated DeltaNet kernel takes bfloat16 only); docs/VLLM.md, "Qwen3.5", has its figures.
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
from vlm_grpo_ma.model.logprobs import sequence_logprobs
from vlm_grpo_ma.model.tiny import build_tiny_qwen3_5

TINY_QWEN3_5 = "tiny-qwen3.5"  # main's model_dir: build_tiny_qwen3_5 into a temporary folder


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


def logprob_gaps(policy: Policy, prompts, tree, num_thoughts: int, num_answers: int) -> torch.Tensor:
    """|trainer - engine| log-prob of every sampled (not forced) token of a K x M tree, thoughts and answers: the
    trainer's forward (``sequence_logprobs``, the policy's dtype) of each answer row, thought + answer."""
    per_prompt = num_thoughts * num_answers
    rows = range(len(tree.answer_ids))
    thought_of = [a // num_answers for a in rows]
    completions = [tree.thought_ids[thought_of[a]] + tree.answer_ids[a] for a in rows]
    with torch.no_grad():
        trainer = sequence_logprobs(policy, prompts, [a // per_prompt for a in rows], completions, temperature=1.0).float().cpu()
    gaps = []
    for a in rows:
        engine_logprobs = torch.tensor(tree.thought_logprobs[thought_of[a]] + tree.answer_logprobs[a])
        sampled = ~torch.tensor(tree.thought_forced[thought_of[a]] + [False] * len(tree.answer_ids[a]), dtype=torch.bool)
        gaps.append((trainer[a, : len(engine_logprobs)] - engine_logprobs).abs()[sampled])
    return torch.cat(gaps)


def bench_engines(policy: Policy, samples, prompts, engine_names: list[str], tree) -> dict:
    """Median seconds, generated tokens, hit rate, prefilled prompt tokens and the log-prob gap of each engine's
    K x M tree over ``tree.repeats`` rounds."""
    engines = {name: make_bench_engine(name, policy, tree.seed) for name in engine_names}
    seconds = {name: [] for name in engines}
    tokens = {name: [] for name in engines}
    hit_rate = {name: [] for name in engines}
    prefilled = {name: [] for name in engines}
    gaps = {name: [] for name in engines}
    for round_index in range(tree.warmup + tree.repeats):
        for name, engine in engines.items():
            settings = SamplingSettings(
                temperature=1.0, max_thought_tokens=tree.max_thought_tokens, max_answer_tokens=tree.max_answer_tokens,
                generators=prompt_generators(tree.seed + round_index, 0, len(prompts)),
            )  # fmt: skip
            is_vllm = hasattr(engine, "forget_cached")
            if is_vllm:  # what a run's weight push does every step: no tree finds the last one's blocks
                engine.forget_cached()
            engine.step_metrics()  # counters from here on are this tree's
            counted = engine.prefix_counters() if is_vllm else None
            started = time.perf_counter()
            with torch.no_grad():
                rollout = engine.sample(policy, samples, prompts, num_thoughts=tree.num_thoughts,
                                        num_answers=tree.num_answers, settings=settings)  # fmt: skip
            elapsed = time.perf_counter() - started
            if round_index < tree.warmup:
                continue
            seconds[name].append(elapsed)
            tokens[name].append(sum(map(len, rollout.tree.thought_ids)) + sum(map(len, rollout.tree.answer_ids)))
            if is_vllm:
                hits, queries = (after - before for after, before in zip(engine.prefix_counters(), counted, strict=True))
                prefilled[name].append(queries - hits)
            else:  # decode.sample_tree prefills each prompt once; thoughts and answers continue from its KV cache
                prefilled[name].append(sum(len(p.input_ids) for p in prompts))
            hit_rate[name].append(engine.step_metrics().get("rollout/prefix_cache_hit_rate", float("nan")))
            gaps[name].append(logprob_gaps(policy, prompts, rollout.tree, rollout.num_thoughts, rollout.num_answers))
    return {
        name: {
            "seconds_per_tree": statistics.median(seconds[name]),
            "generated_tokens": statistics.mean(tokens[name]),
            "prefix_cache_hit_rate": statistics.mean(hit_rate[name]),
            "prompt_tokens_prefilled": statistics.mean(prefilled[name]),
            "logprob_gap_max": float(torch.cat(gaps[name]).max()),
            "logprob_gap_mean": float(torch.cat(gaps[name]).mean()),
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
    """One line per model: per engine seconds per tree, generated tokens, hit rate, prompt tokens prefilled and
    the log-prob gap (max / mean) against the trainer."""
    cell_header = "{:>12} {:>7} {:>8} {:>9} {:>9} {:>9}"
    header = f"{'model':<12} {'params':>8} | " + " | ".join(
        cell_header.format(name + " s/tree", "tokens", "hit rate", "prefilled", "gap max", "gap mean") for name in engine_names
    )
    if len(engine_names) == 2:
        header += f" | {engine_names[0]}/{engine_names[1]}"
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = []
        for n in engine_names:
            e = row["engines"][n]
            rate = e["prefix_cache_hit_rate"]
            cells.append(
                f"{e['seconds_per_tree']:>12.3f} {e['generated_tokens']:>7.0f} " + (f"{rate:>8.2f}" if rate == rate else f"{'-':>8}")
                + f" {e.get('prompt_tokens_prefilled', float('nan')):>9.0f} {e.get('logprob_gap_max', float('nan')):>9.2e}"
                f" {e.get('logprob_gap_mean', float('nan')):>9.2e}"
            )  # fmt: skip
        line = f"{row['model']:<12} {row['params'] / 1e6:>7.2f}M | " + " | ".join(cells)
        if len(engine_names) == 2:
            a, b = (row["engines"][n]["seconds_per_tree"] for n in engine_names)
            line += f" | {a / b:>5.2f}x"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m vlm_grpo_ma.tools.bench_engines MODEL_DIR``: the engines on one model folder (scripts/gpu_check.py's
    'engines' section runs it on the random 3B model), or on ``tiny-qwen3.5`` (``build_tiny_qwen3_5``, built into a
    temporary folder): bf16 on a GPU, fp32 on the CPU but bf16 for a hybrid model (vLLM's CPU Gated DeltaNet)."""
    import tempfile

    from vlm_grpo_ma.engines.vllm import hybrid_model
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.model.prompts import encode_prompt
    from vlm_grpo_ma.task_api.registry import get_task
    from vlm_grpo_ma.tools.bench_inputs import BenchTree, bench_samples, load_average

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("model_dir", help=f"a model folder, or {TINY_QWEN3_5}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: see above")
    parser.add_argument("--engine", default="hf,vllm")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--thoughts", type=int, default=4)
    parser.add_argument("--answers", type=int, default=4)
    parser.add_argument("--thought-tokens", type=int, default=40)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--max-pixels", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vlm-grpo-ma-bench-") as workdir:
        model_dir = str(build_tiny_qwen3_5(Path(workdir) / TINY_QWEN3_5)) if args.model_dir == TINY_QWEN3_5 else args.model_dir
        dtype = args.dtype or ("bfloat16" if args.device == "cuda" or hybrid_model(model_dir) else "float32")
        policy = load_policy(model_dir, dtype=dtype, max_pixels=args.max_pixels, min_pixels=args.max_pixels, device=args.device)
        policy.model.eval()
        samples = bench_samples(args.prompts)
        prompts = [encode_prompt(policy, s, get_task("grounding").instruction) for s in samples]
        names = [n.strip() for n in args.engine.split(",") if n.strip()]
        tree = BenchTree(num_thoughts=args.thoughts, num_answers=args.answers, max_thought_tokens=args.thought_tokens,
                         max_answer_tokens=args.answer_tokens, repeats=args.repeats, warmup=args.warmup)  # fmt: skip
        print(
            f"{Path(model_dir).name} ({dtype}): B={args.prompts} K={args.thoughts} M={args.answers} thought<={args.thought_tokens}"
            f" answer<={args.answer_tokens} tok, prompts of {min(len(p.input_ids) for p in prompts)}-"
            f"{max(len(p.input_ids) for p in prompts)} tokens, repeats={args.repeats} (+{args.warmup} warm-up), alternating;"
            f" load average before: {load_average()}",
            flush=True,
        )
        row = {"model": Path(model_dir).name, "params": sum(p.numel() for p in policy.model.parameters())}
        row["engines"] = bench_engines(policy, samples, prompts, names, tree)
    print(format_engines_table([row], names), flush=True)
    print(f"load average after: {load_average()}; gap: |trainer - engine| log-prob of the sampled tokens, trainer in {dtype}")


if __name__ == "__main__":
    main()
