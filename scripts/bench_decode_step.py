"""The sampling part of one decode step at Qwen's real vocabulary (151,936 tokens): before and after sampling
on the model's device. Prints figures; not a test.

    .venv/bin/python scripts/bench_decode_step.py [--rows 128] [--prompts 4] [--repeats 10] [--device cuda]
        [--cache-rows 64 --cache-prompt 512 --cache-steps 128]

"before": per-prompt generators on the host, as the sampler had them: the [rows x vocab] probabilities are
copied to the host at every decoded token (rows x vocab x 4 bytes; 78 MB at 128 rows). "after": the
generators moved to the model's device by ``decode._generators_on`` (what ``sample_tree`` now does): only the
sampled ids come back. On a CPU-only machine the two are the same path (nothing to copy); the figures that
matter come from a GPU (not measured yet: no GPU machine so far). Then one KV cache layer: appending a
token by ``torch.cat`` (copies the whole layer) against the preallocated buffer ``sample_tree`` now uses.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlm_grpo_ma.engines.decode import SamplingSettings, _generators_on, _sample_tokens, prompt_generators

QWEN_VOCABULARY = 151_936


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_sampling(logits: torch.Tensor, settings: SamplingSettings, repeats: int) -> float:
    """Median seconds of one ``_sample_tokens`` call (the decode step's sampling) over ``repeats``."""
    times = []
    for _ in range(repeats + 2):  # two warm-up calls
        _synchronize(logits.device)
        started = time.perf_counter()
        tokens, _ = _sample_tokens(logits, settings, suppressed=[])
        tokens.tolist()  # the ids reach the host, as the decode loop needs them
        _synchronize(logits.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def time_cache_appends(layer_factory, rows: int, prompt: int, steps: int, heads: int, head_dim: int) -> float:
    """Seconds to append ``steps`` single tokens to one KV cache layer holding ``prompt`` tokens per row."""
    layer = layer_factory()
    prefix = torch.randn(rows, heads, prompt, head_dim)
    layer.update(prefix, prefix.clone())
    token = torch.randn(rows, heads, 1, head_dim)
    started = time.perf_counter()
    for _ in range(steps):
        layer.update(token, token)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="rows decoded together (prompts x K, or x K x M)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts (one generator each)")
    parser.add_argument("--vocabulary", type=int, default=QWEN_VOCABULARY)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cache-rows", type=int, default=64)
    parser.add_argument("--cache-prompt", type=int, default=512)
    parser.add_argument("--cache-steps", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocabulary, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    host = SamplingSettings(temperature=1.0, generators=prompt_generators(0, 0, args.prompts))
    on_device = _generators_on(SamplingSettings(temperature=1.0, generators=prompt_generators(0, 0, args.prompts)), device)
    copied = args.rows * args.vocabulary * 4 if device.type != "cpu" else 0
    before, after = time_sampling(logits, host, args.repeats), time_sampling(logits, on_device, args.repeats)
    print(f"decode step sampling, {args.rows} rows x {args.vocabulary:,} tokens, {args.prompts} prompt generators, device {device}")
    print(f"  before (host generators): {before * 1e3:8.2f} ms per token, {copied / 1e6:6.1f} MB copied to the host")
    print(f"  after  (device generators): {after * 1e3:6.2f} ms per token, {args.rows * 8 / 1e6:6.4f} MB (the sampled ids)")
    if device.type == "cpu":
        print("  (CPU: both are the same path, nothing is copied; the difference shows on a GPU)")
    # The KV cache: one layer of Qwen2.5-VL-3B's shape (2 key-value heads of 128), torch.cat per token
    # (transformers' DynamicLayer) against the preallocated buffer sample_tree now uses.
    from transformers.cache_utils import DynamicLayer

    from vlm_grpo_ma.model.cache import _preallocated_layer_class

    rows, prompt, steps = args.cache_rows, args.cache_prompt, args.cache_steps
    grown = time_cache_appends(DynamicLayer, rows, prompt, steps, 2, 128)
    preallocated = time_cache_appends(lambda: _preallocated_layer_class()(prompt + steps), rows, prompt, steps, 2, 128)
    print(f"KV cache, one layer (2 heads x 128), {rows} rows, {prompt}-token prefix, {steps} decoded tokens, CPU fp32")
    print(f"  before (torch.cat per token): {grown / steps * 1e3:7.3f} ms per token per layer")
    print(f"  after  (preallocated):        {preallocated / steps * 1e3:7.3f} ms per token per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
