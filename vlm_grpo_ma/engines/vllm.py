"""The ``vllm`` rollout engine: an in-process vLLM ``LLM`` samples the K x M tree through its prefix cache.

Stage 1 sends each prompt (its image as ``multi_modal_data``) with ``n = K`` and stops at the thought's stop
text (a thought that reaches its limit gets the closing tag forced, as the HF engine does). Stage 2 sends each
thought as prompt ids + thought ids with ``n = M``: the prompt's and thought's KV blocks are found in the
prefix cache, not recomputed. Prompts are sent as token ids with one image placeholder per image (vLLM expands
it to the image's patch count; already-expanded ids would be expanded again).

After every update ``push_weights`` loads the policy's weights into the engine (LoRA: merged) and resets its
encoder cache (image features of the old vision tower) and prefix cache (KV of the old weights).

Facts this depends on (docs/VLLM.md): the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one
process only); the prefix cache reuses full blocks only, and the CPU backend takes block sizes that are
multiples of 32 (its default, 128, gives no hit on ~105-token prompts); per-request seeds crash the CPU build,
so each stage runs under torch's global generator seeded from the step's seed (``_seeded``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Sequence

import torch

from vlm_grpo_ma.engines.decode import SamplingSettings, TreeSample
from vlm_grpo_ma.engines.rollout import Rollout, rollout_from_tree
from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.model.prompts import EncodedPrompt, open_image

INSTALL_COMMAND = "scripts/setup.sh --vllm"
BLOCK_SIZE = 32  # tokens per KV block: the CPU backend's smallest; only full blocks are shared between requests
# the environment variable that makes VLLM_REQUIRED tests fail (not skip) when vLLM is missing
REQUIRE_ENV = "VLM_GRPO_MA_REQUIRE_VLLM"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_vllm(num_processes: int, *, tensor_parallel_size: int = 1, sleep: bool = False) -> None:
    """ValueError, saying why and what to set instead, where the engine cannot run here (the run turns it into
    a config error before anything loads)."""
    if not vllm_installed():
        raise ValueError(
            f"rollout.engine=vllm but vLLM is not installed in this environment; install it with `{INSTALL_COMMAND}`"
            " (or use rollout.engine=hf)"
        )
    if num_processes > 1:
        raise ValueError(
            f"rollout.engine=vllm runs in one process only (the in-process engine); this launch has {num_processes}"
            " processes: use rollout.engine=hf with several processes"
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"rollout.vllm_tensor_parallel_size={tensor_parallel_size}: the engine runs in the trainer's"
            " process and gets the weights as tensors there, which one worker takes; several tensor-parallel workers"
            " (separate processes) are not supported yet: set it to 1"
        )
    if sleep and not torch.cuda.is_available():
        raise ValueError("rollout.vllm_sleep=true needs a GPU (vLLM's sleep mode frees GPU memory); set it to false")


def unexpanded_ids(input_ids: Sequence[int], image_token_id: int) -> list[int]:
    """Prompt ids with each run of image placeholders collapsed to one (the form vLLM expands itself)."""
    out: list[int] = []
    for token in input_ids:
        if not (token == image_token_id and out and out[-1] == image_token_id):
            out.append(token)
    return out


def merged_state_dict(policy: Policy) -> dict[str, torch.Tensor]:
    """The policy's weights under the model's own names, LoRA adapters folded in (``W + delta``, computed, the
    model untouched): what a model folder saved from a merge would hold."""
    state = policy.model.state_dict()
    if policy.adapter is None:
        return state
    from peft.tuners.lora import LoraLayer

    adapter_name = policy.adapter.active_adapter
    merged = {}
    with torch.no_grad():
        for name, module in policy.model.named_modules():
            if isinstance(module, LoraLayer) and adapter_name in module.lora_A:
                merged[f"{name}.weight"] = module.base_layer.weight + module.get_delta_weight(adapter_name)
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        out[key] = merged.get(key, value)
    return out


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str,
        seed: int,
        max_images: int = 1,  # images per prompt the engine reserves room for (the built-in tasks: 1)
        gpu_memory_utilization: float = 0.35,
        kv_cache_gib: float = 1.0,
        tensor_parallel_size: int = 1,
        sleep: bool = False,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: weights pushed as tensors
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
        from vllm import LLM

        pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=True,
            block_size=BLOCK_SIZE,
            enforce_eager=not on_gpu,  # CPU: starts in seconds; GPU: CUDA graphs
            limit_mm_per_prompt={"image": max_images, "video": 0},
            mm_processor_kwargs=pixels or None,
            disable_log_stats=False,  # the prefix-cache counters
            logprobs_mode="processed_logprobs",  # after temperature and the suppressed tokens, as the trainer's
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=sleep,
        )
        self.sleep, self.max_images = sleep, max_images
        self.asleep = False  # put to sleep after sampling (vllm_sleep), woken before the next sample or push
        # The CPU worker replaces torch.set_num_threads with a warning, which image processing then prints
        # thousands of times a step; the thread count is the engine's either way.
        logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(lambda record: "set_num_threads" not in record.getMessage())
        self._counted = self._prefix_counters()

    # ------------------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def push_weights(self, policy: Policy) -> None:
        """Load the policy's current weights into the engine, then drop everything computed with the old ones:
        the encoder cache (image features) and the prefix cache (KV blocks)."""
        self._wake()
        state = merged_state_dict(policy)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()

    def sample(
        self,
        policy: Policy,
        samples: Sequence,
        prompts: Sequence[EncodedPrompt],
        *,
        num_thoughts: int,
        num_answers: int,
        settings: SamplingSettings,
    ) -> Rollout:
        self._wake()  # dynamic sampling samples again before the next push
        tree = self.sample_tree(policy, samples, prompts, num_thoughts=num_thoughts, num_answers=num_answers, settings=settings)
        if self.sleep:
            self.llm.sleep(level=1)  # weights to host memory, KV cache freed, until the next sample or push
            self.asleep = True
        return rollout_from_tree(policy, samples, prompts, tree, num_thoughts=num_thoughts, num_answers=num_answers)

    def sample_tree(self, policy, samples, prompts, *, num_thoughts: int, num_answers: int, settings: SamplingSettings) -> TreeSample:
        from vllm import SamplingParams

        if settings.temperature <= 0:
            raise ValueError(f"the vllm engine samples at temperature > 0 (got {settings.temperature}); greedy evaluation uses the HF path")
        eos = policy.eos_token_ids
        close_ids = policy.tokenizer.encode(settings.thought_stop, add_special_tokens=False)
        common = dict(
            temperature=settings.temperature,
            top_p=settings.top_p,
            stop_token_ids=eos,
            include_stop_str_in_output=True,
            skip_special_tokens=False,  # a stop text may be a special token (</think>)
            logprobs=0,  # the sampled token's log-prob
            logit_bias={token: float("-inf") for token in policy.suppressed_token_ids},
        )
        # a thought that has not stopped when only the closing tag's tokens remain gets them forced
        thought_params = SamplingParams(n=num_thoughts, max_tokens=max(settings.max_thought_tokens - len(close_ids), 1),
                                        stop=[settings.thought_stop], **common)  # fmt: skip
        answer_params = SamplingParams(n=num_answers, max_tokens=settings.max_answer_tokens, stop=[settings.answer_stop], **common)
        images = [[open_image(image) for image in sample.images] for sample in samples]
        if max(map(len, images), default=0) > self.max_images:
            raise ValueError(
                f"a prompt has {max(map(len, images))} images; the vllm engine was started for at most {self.max_images}"
                " (the built-in tasks have one): use rollout.engine=hf for this task"
            )
        heads = [unexpanded_ids(p.input_ids, policy.image_token_id) for p in prompts]

        def request(b: int, ids: list[int]) -> dict:
            return {"prompt_token_ids": ids, **({"multi_modal_data": {"image": images[b]}} if images[b] else {})}

        with _seeded(settings):
            stage1 = self.llm.generate([request(b, heads[b]) for b in range(len(prompts))], thought_params, use_tqdm=False)
        thought_ids, thought_logprobs, thought_forced, thought_truncated = [], [], [], []
        for b, output in enumerate(stage1):
            if list(output.prompt_token_ids) != list(prompts[b].input_ids):
                raise RuntimeError(
                    f"vLLM expanded prompt {b} to {len(output.prompt_token_ids)} tokens, the trainer's processor to"
                    f" {len(prompts[b].input_ids)}: the engine and the trainer would see different images"
                )
            for completion in output.outputs:
                ids, logprobs = _ids_and_logprobs(completion)
                truncated = completion.finish_reason == "length"
                forced = [False] * len(ids)
                if truncated:
                    ids, logprobs, forced = ids + close_ids, logprobs + [0.0] * len(close_ids), forced + [True] * len(close_ids)
                thought_ids.append(ids)
                thought_logprobs.append(logprobs)
                thought_forced.append(forced)
                thought_truncated.append(truncated)
        thought_prompt = [t // num_thoughts for t in range(len(thought_ids))]
        with _seeded(settings):
            stage2 = self.llm.generate(
                [request(b, heads[b] + ids) for b, ids in zip(thought_prompt, thought_ids, strict=True)], answer_params, use_tqdm=False
            )
        answer_ids, answer_logprobs, answer_truncated = [], [], []
        for output in stage2:
            for completion in output.outputs:
                ids, logprobs = _ids_and_logprobs(completion)
                answer_ids.append(ids)
                answer_logprobs.append(logprobs)
                answer_truncated.append(completion.finish_reason == "length")
        return TreeSample(
            thought_ids=thought_ids,
            thought_logprobs=thought_logprobs,
            thought_forced=thought_forced,
            thought_truncated=thought_truncated,
            thought_ended_turn=[bool(ids) and ids[-1] in eos for ids in thought_ids],
            answer_ids=answer_ids,
            answer_logprobs=answer_logprobs,
            answer_truncated=answer_truncated,
            vision_images_encoded=sum(len(i) for i in images),
        )

    # ------------------------------------------------------------------------------------------------------

    def _prefix_counters(self) -> tuple[float, float]:
        """(prefix-cache hits, queried tokens) counted by the engine so far."""
        values = {metric.name: getattr(metric, "value", None) for metric in self.llm.get_metrics()}
        return float(values.get("vllm:prefix_cache_hits") or 0.0), float(values.get("vllm:prefix_cache_queries") or 0.0)

    def step_metrics(self) -> dict[str, float]:
        """The prefix-cache hit rate since the last call (one step): hit tokens / queried tokens."""
        hits, queries = self._prefix_counters()
        step_hits, step_queries = hits - self._counted[0], queries - self._counted[1]
        self._counted = (hits, queries)
        return {"rollout/prefix_cache_hit_rate": step_hits / step_queries if step_queries else 0.0}


@contextlib.contextmanager
def _seeded(settings: SamplingSettings):
    """The in-process engine samples from torch's global generator (per-request seeds crash the CPU build): seeded
    here from the first prompt's generator, so a step's tree is a function of (train.seed, step, prompts), as
    with the HF engine (a resumed run samples the same trees), and the global generator is restored after."""
    if settings.generators is None:
        yield
        return
    seed = int(torch.randint(2**62, (), generator=settings.generators[0]))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def _ids_and_logprobs(completion) -> tuple[list[int], list[float]]:
    ids = list(completion.token_ids)
    return ids, [float(step[token].logprob) for step, token in zip(completion.logprobs, ids, strict=True)]

