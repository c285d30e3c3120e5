"""What vLLM's prefix cache gives GRPO-MA's tree on a hybrid model (Qwen3.5: Gated DeltaNet layers beside attention).

    python scripts/vllm_hybrid_prefix.py            # about 2 min on 2 CPU cores; needs scripts/setup.sh --vllm

Three parts, printed in turn (docs/VLLM.md, "Qwen3.5", has the figures and what they mean):

1. The block size vLLM 0.32 chooses, asked of vLLM's own code (``Platform._align_hybrid_block_size`` on a config-only
   engine config: no weights), for the tiny Qwen3.5 (``model/tiny.build_tiny_qwen3_5``) and the published
   sizes of ``model/architectures.py``. On a hybrid model the attention block is raised until one block's KV page
   holds one recurrent-state page, so the block follows the ratio of the state's size to the KV bytes a token.
2. What the answer stage prefills per thought at those block sizes, for prompts and thoughts of typical lengths:
   from the rules read in vLLM 0.32 and checked on the tiny model (below): a recurrent state is kept only where a
   prefill stopped (a block boundary inside a prefill, and with ``prefix_match_unit`` the prompt's last boundary of
   that unit), never at a position reached while decoding, so a thought's own end is never a cached state.
3. The tiny Qwen3.5's K x M tree through ``VLLMEngine`` under three settings, each in its own process (vLLM's
   prefix-cache counters are the process's): ``blocks`` (vLLM's default: hits on whole blocks only), ``unit``
   (``prefix_match_unit=32``, the engine's setting for hybrid models, without its prefill-first request) and
   ``unit+prefill`` (the engine as it is). Per ``generate`` call: requests x n, engine steps, hit / queried prompt
   tokens; the prompt tokens prefilled per tree. Steps and tokens do not depend on the machine's load; seconds do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

UNIT = 32  # VLLMEngine's prefix_match_unit on hybrid models (vlm_grpo_ma.engines.vllm.BLOCK_SIZE)
SETTINGS = ("blocks", "unit", "unit+prefill")
PUBLISHED = ("qwen3.5-2b", "qwen3.5-4b")


# ----------------------------------------------------------------------------------------------------------
# 1. block sizes


def _config_folder(name: str, out: Path, tiny_dir: Path) -> Path:
    """config.json of a published size (model/architectures.py) beside the tiny model's processor files."""
    import shutil

    from vlm_grpo_ma.model.architectures import ARCHITECTURES, build_config
    from vlm_grpo_ma.model.tiny import build_tokenizer

    config = build_config(ARCHITECTURES[name], build_tokenizer())  # the tiny tokenizer's ids, as the copied files
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    for file in tiny_dir.iterdir():
        if file.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(file, out / file.name)
    return out


def block_size(model_dir: Path, ssm_dtype: str) -> int:
    """The attention (and Mamba) block size vLLM sets for this model with the engine's settings (block_size 32,
    prefix caching, bfloat16), the recurrent state stored in ``ssm_dtype``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = EngineArgs(model=str(model_dir), dtype="bfloat16", enable_prefix_caching=True, block_size=UNIT, enforce_eager=True,
                        skip_tokenizer_init=True, mamba_ssm_cache_dtype=ssm_dtype).create_engine_config()  # fmt: skip
    type(current_platform)._align_hybrid_block_size(config, CPUAttentionBackend)
    return config.cache_config.block_size


# ----------------------------------------------------------------------------------------------------------
# 2. the answer stage's prefill per thought


def answer_stage_prefill(prompt: int, thought: int, answers: int, block: int, unit: int = UNIT) -> dict[str, int]:
    """Prompt tokens the answer stage prefills for one thought of a prompt of ``prompt`` tokens.

    ``blocks``: the first answer resumes from the prompt's last whole block (kept by stage 1's prefill) and
    prefills the rest; the other M - 1 wait a step and resume from the first one's last whole block.
    ``unit+prefill``: the prefill-first request resumes from the prompt's last ``unit`` boundary (kept by stage 1's
    prefill-first request) and prefills the rest; the M answers resume from its last ``unit`` boundary.
    ``hf``: the answers continue from the thought's own KV cache (decode.sample_tree): nothing."""
    length = prompt + thought

    def resumed_at(tokens: int, step: int) -> int:  # a hit leaves at least the last token to compute
        return (tokens - 1) // step * step

    return {
        "blocks": (length - resumed_at(prompt, block)) + (answers - 1) * (length - resumed_at(length, block)),
        "unit+prefill": (length - resumed_at(prompt, unit)) + answers * (length - resumed_at(length, unit)),
        "hf": 0,
    }


# ----------------------------------------------------------------------------------------------------------
# 3. the tiny model's tree under each setting (one process each)


def measure(setting: str, model_dir: str, prompts: int, thoughts: int, answers: int) -> dict:
    import time

    import torch
    import vllm

    from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
    from vlm_grpo_ma.engines.vllm import VLLMEngine
    from vlm_grpo_ma.model.loading import load_policy
    from vlm_grpo_ma.model.prompts import encode_prompt
    from vlm_grpo_ma.task_api.registry import get_task
    from vlm_grpo_ma.tools.bench_inputs import bench_samples

    if setting == "blocks":  # the engine's LLM(...) without prefix_match_unit
        original = vllm.LLM

        def without_unit(**kwargs):
            kwargs.pop("prefix_match_unit", None)
            return original(**kwargs)

        vllm.LLM = without_unit
    policy = load_policy(model_dir, dtype="bfloat16")
    policy.model.eval()
    samples = bench_samples(prompts)
    encoded = [encode_prompt(policy, s, get_task("grounding").instruction) for s in samples]
    engine = VLLMEngine(model_dir, dtype="bfloat16", seed=0, max_pixels=policy.processor.image_processor.size["longest_edge"])
    engine.prefill_first = setting == "unit+prefill"
    engine.push_weights(policy)
    steps = [0]
    engine_step, generate = engine.llm.llm_engine.step, engine.llm.generate

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return engine_step(*args, **kwargs)

    calls = []

    def counted_generate(requests, params, **kwargs):
        before, (hits, queries) = steps[0], engine.prefix_counters()
        out = generate(requests, params, **kwargs)
        after_hits, after_queries = engine.prefix_counters()
        calls.append(dict(requests=len(requests), n=params.n, max_tokens=params.max_tokens, steps=steps[0] - before,
                          hits=int(after_hits - hits), queried=int(after_queries - queries)))  # fmt: skip
        return out

    engine.llm.llm_engine.step, engine.llm.generate = counted_step, counted_generate
    trees = []
    for tree_index in range(2):  # the first one also warms the engine up
        engine.llm.reset_prefix_cache()  # as a run's weight push does every step
        engine.llm.llm_engine.reset_encoder_cache()
        calls.clear()
        settings = SamplingSettings(temperature=1.0, max_thought_tokens=40, max_answer_tokens=24,
                                    generators=prompt_generators(tree_index, 0, prompts))  # fmt: skip
        started = time.perf_counter()
        with torch.no_grad():
            engine.sample_tree(policy, samples, encoded, num_thoughts=thoughts, num_answers=answers, settings=settings)
        trees.append(dict(calls=list(calls), seconds=time.perf_counter() - started))
    return dict(setting=setting, prompt_tokens=[len(p.input_ids) for p in encoded], tree=trees[-1])


def _measure_in_subprocess(setting: str, model_dir: Path, args) -> dict:
    command = [sys.executable, __file__, "--measure", setting, "--model-dir", str(model_dir), "--prompts", str(args.prompts),
               "--thoughts", str(args.thoughts), "--answers", str(args.answers)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"measuring {setting} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--thoughts", type=int, default=4)
    parser.add_argument("--answers", type=int, default=4)
    parser.add_argument("--measure", choices=SETTINGS, help=argparse.SUPPRESS)  # one setting, in this process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print("RESULT " + json.dumps(measure(args.measure, args.model_dir, args.prompts, args.thoughts, args.answers)), flush=True)
        return
    from vlm_grpo_ma.model.tiny import build_tiny_qwen3_5

    with tempfile.TemporaryDirectory(prefix="vllm-hybrid-prefix-") as workdir:
        tiny = build_tiny_qwen3_5(Path(workdir) / "tiny-qwen3.5")
        folders = {"tiny-qwen3.5": tiny, **{name: _config_folder(name, Path(workdir) / name, tiny) for name in PUBLISHED}}
        blocks = {name: {dtype: block_size(folder, dtype) for dtype in ("float32", "bfloat16")} for name, folder in folders.items()}
        print("\n1. vLLM 0.32's block size (tokens) with the engine's settings, recurrent state in float32 (the CPU build's")
        print("   choice, and the published Qwen3.5 configs' mamba_ssm_dtype) / in bfloat16:")
        for name, sizes in blocks.items():
            print(f"   {name:<13} {sizes['float32']:>5} / {sizes['bfloat16']:>4}")
        print(f"\n2. Prompt tokens the answer stage prefills per thought (M={args.answers}), by vLLM's rules; block = the float32-state")
        print(f"   block of {PUBLISHED[0]}: {blocks[PUBLISHED[0]]['float32']} tokens; unit = {UNIT} (the engine's prefix_match_unit)")
        block = blocks[PUBLISHED[0]]["float32"]
        print(f"   {'prompt':>6} {'thought':>7} | {'blocks':>6} {'unit+prefill':>12} {'hf':>3} | tokens of prompt + thought")
        for prompt in (260, 1100):  # a 448 px image (196 tokens) and a 1024 px one (1024) + ~60 text tokens
            for thought in (64, 128, 256, 512):
                cost = answer_stage_prefill(prompt, thought, args.answers, block)
                print(f"   {prompt:>6} {thought:>7} | {cost['blocks']:>6} {cost['unit+prefill']:>12} {cost['hf']:>3} | {prompt + thought}")
        print(f"\n3. The tiny Qwen3.5's tree through VLLMEngine, B={args.prompts} K={args.thoughts} M={args.answers}, thoughts <= 40 and"
              " answers <= 24 tokens (the second of two trees; caches emptied before each):")  # fmt: skip
        for setting in SETTINGS:
            result = _measure_in_subprocess(setting, tiny, args)
            tree = result["tree"]
            hits, queried = sum(c["hits"] for c in tree["calls"]), sum(c["queried"] for c in tree["calls"])
            print(f"   {setting:<13} prompts of {min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} tokens: prefilled"
                  f" {queried - hits} of {queried} queried (hit rate {hits / max(queried, 1):.2f}),"
                  f" {sum(c['steps'] for c in tree['calls'])} engine steps, {tree['seconds']:.2f} s")  # fmt: skip
            for call in tree["calls"]:
                print(f"      {call['requests']:>3} requests x n={call['n']:<2} max_tokens={call['max_tokens']:<3} {call['steps']:>3} steps,"
                      f" hits {call['hits']:>5} / {call['queried']:>5}")  # fmt: skip


if __name__ == "__main__":
    main()
