"""The ``vllm`` rollout engine: an in-process vLLM ``LLM`` samples the K x M tree through its prefix cache.

Stage 1 sends each prompt (its image as ``multi_modal_data``) with ``n = K`` and stops at the thought's stop
text (a thought that reaches its limit gets the closing tag forced, as the HF engine does). Stage 2 sends each
thought as prompt ids + thought ids with ``n = M``: the prompt's and thought's KV blocks are found in the
prefix cache, not recomputed. Prompts are sent as token ids with one placeholder per image and per video
(``EncodedPrompt.unexpanded_ids``: the trainer's processor ids with each expansion collapsed; vLLM expands them
itself, Qwen3-VL's frame timestamps included; already-expanded ids would be expanded again), with the images and
the frames and metadata the HF path gives its processor (``prompts.PromptMedia``); vLLM's own mRoPE positions are
the trainer's (``prompts.text_after_video_positions``; docs/VLLM.md, "Video"). A model whose videos vLLM cannot
read here (Qwen3-VL, Qwen3.5 under vLLM 0.32 and transformers 5.25) is refused when the engine starts for data
with videos (``check_videos``).

Every process of a launch hosts the engine in-process: one process alone runs vLLM's own single-worker
executor; a launch of N processes gives vLLM its process group (``distributed_executor_backend=
"external_launcher"``), and each group of ``tensor_parallel_size`` consecutive processes forms one engine
(N / TP engines). The members of a group send the same requests (the group's prompts, under the same seed)
and each keeps its own share of the tree (``processes_per_engine``: the run's loop slices it). A thought's M
answers are asked of the engine that sampled the thought, so its KV blocks are in that engine's prefix cache.

After every update ``push_weights`` streams the policy's weights into the engine one tensor at a time in the
engine's dtype (``streamed_weights``: FSDP gathers each parameter, LoRA merges each adapted layer; never a
second whole copy of the model) and resets its encoder cache (image features of the old vision tower) and
prefix cache (KV of the old weights). Every process pushes: under FSDP the gathers are collective.

Facts this depends on (docs/VLLM.md): the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the prefix
cache reuses full blocks only, and the CPU backend takes block sizes that are multiples of 32 (its default,
128, gives no hit on ~105-token prompts); per-request seeds crash the CPU build, so each stage runs under
torch's global generator seeded from the step's seed (``_seeded``); vLLM's teardown destroys the default
process group, so the run closes the engine (``close``) as its last collective act.

Hybrid models (Qwen3.5: Gated DeltaNet layers beside attention; docs/VLLM.md, "Qwen3.5"): vLLM raises the block to
hold a recurrent-state page (1056 tokens on the tiny model, 544 at 2B/4B) and keeps a recurrent state only where a
prefill stopped, never where decoding reached, so block-sized hits gave none on the tiny model's tree. The engine
sets ``prefix_match_unit`` (hits at 32-token boundaries: a request's prefill stops at its prompt's last one, whose
state is kept) and prefills each stage's prefixes once before their ``n`` samples (``_prefill_first``). A
thought's answers then prefill at most 32 tokens each, after one request a thought has prefilled its thought;
the HF engine's answers prefill nothing. vLLM's CPU kernel for these layers takes bfloat16 only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
from collections.abc import Iterator, Sequence

import torch

from vlm_grpo_ma.engines.decode import SamplingSettings, TreeSample
from vlm_grpo_ma.engines.rollout import Rollout, readable_thought_ids, rollout_from_tree
from vlm_grpo_ma.engines.tool_server import ToolServer
from vlm_grpo_ma.model import linear_attention
from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.model.prompts import EncodedPrompt, PromptMedia
from vlm_grpo_ma.task_api.videos import DecodedVideo

INSTALL_COMMAND = "scripts/setup.sh --vllm"
BLOCK_SIZE = 32  # tokens per KV block: the CPU backend's smallest; only full blocks are shared between requests
# the environment variable that makes VLLM_REQUIRED tests fail (not skip) when vLLM is missing
REQUIRE_ENV = "VLM_GRPO_MA_REQUIRE_VLLM"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_vllm(num_processes: int, *, tensor_parallel_size: int = 1, sleep: bool = False) -> None:
    """ValueError, saying why and what to set instead, where the engine cannot run here (the run turns it into
    a config error before anything loads): vLLM missing, or installed but failing to import (built for another
    torch), or a tensor-parallel size that does not split the launch's processes into whole groups."""
    if not vllm_installed():
        raise ValueError(
            f"rollout.engine=vllm but vLLM is not installed in this environment; install it with `{INSTALL_COMMAND}`"
            " (or use rollout.engine=hf)"
        )
    try:
        import vllm  # noqa: F401  (what the engine imports when it starts, minutes later)
    except Exception as error:  # an ImportError or OSError of a build made for another torch or platform
        raise ValueError(
            f"rollout.engine=vllm but vLLM is installed and does not import: {type(error).__name__}: {error}."
            f" Reinstall it for this torch with `{INSTALL_COMMAND}` (or use rollout.engine=hf)"
        ) from None
    if tensor_parallel_size < 1 or num_processes % tensor_parallel_size:
        valid = [size for size in range(1, num_processes + 1) if num_processes % size == 0]
        raise ValueError(
            f"rollout.vllm_tensor_parallel_size={tensor_parallel_size}: each group of that many processes hosts one"
            f" engine, so it must divide the launch's {num_processes} process(es); valid: {', '.join(map(str, valid))}"
        )
    if sleep and not torch.cuda.is_available():
        raise ValueError("rollout.vllm_sleep=true needs a GPU (vLLM's sleep mode frees GPU memory); set it to false")


def check_hybrid_dtype(model_dir: str, dtype: str, *, hybrid: bool | None = None) -> None:
    """ValueError where vLLM's CPU build cannot run the model in ``dtype``: its kernel for Qwen3.5's Gated
    DeltaNet layers takes bfloat16 only (``hybrid``: already known, else read from the folder's config)."""
    if torch.cuda.is_available() or dtype == "bfloat16":
        return
    if hybrid if hybrid is not None else hybrid_model(model_dir):
        raise ValueError(
            f"{model_dir} has Gated DeltaNet layers (Qwen3.5) and vLLM's CPU kernel for them takes bfloat16 only"
            f" (the engine's dtype is {dtype}); set model.dtype=bfloat16, or use rollout.engine=hf"
        )


def hybrid_model(model_dir: str) -> bool:
    """Whether the model mixes recurrent (Gated DeltaNet) layers with attention (Qwen3.5): its config's
    ``layer_types`` name a linear-attention layer."""
    from transformers import AutoConfig

    return linear_attention.is_hybrid(AutoConfig.from_pretrained(model_dir))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor: all-gathered, collective), else the tensor itself."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


def streamed_weights(policy: Policy, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the model's own names, one tensor at a time, in ``dtype``: what a model
    folder saved from the policy (LoRA: merged) holds, without ever holding a second whole copy of the model.
    FSDP2 shards are gathered one parameter at a time (every process must consume the stream in the same
    order: the gathers are collective); a LoRA-adapted layer is merged as it is reached, ``W + scale * B @ A``
    computed in fp32 and cast, the model untouched."""
    adapted = {}
    if policy.adapter is not None:
        from peft.tuners.lora import LoraLayer

        adapter_name = policy.adapter.active_adapter
        adapted = {f"{name}.base_layer.weight": module for name, module in policy.model.named_modules()
                   if isinstance(module, LoraLayer) and adapter_name in module.lora_A}  # fmt: skip
    with torch.no_grad():
        for key, value in policy.model.state_dict().items():
            if ".lora_" in key:
                continue
            tensor = _whole(value)
            module = adapted.get(key)
            if module is not None:
                delta = _whole(module.lora_B[adapter_name].weight).float() @ _whole(module.lora_A[adapter_name].weight).float()
                if module.fan_in_fan_out:
                    delta = delta.T
                tensor = tensor.float() + delta * module.scaling[adapter_name]
            yield key.replace(".base_layer.", "."), tensor.to(dtype)


class VLLMEngine:
    name = "vllm"
    samples_with_policy = False  # the trainer's model is not called while sampling: no FSDP gather, no autocast

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str,
        seed: int,
        max_images: int = 1,  # images per prompt the engine reserves room for (the run: the data's most)
        max_videos: int = 0,  # videos per prompt, likewise
        gpu_memory_utilization: float = 0.35,
        kv_cache_gib: float = 1.0,
        tensor_parallel_size: int = 1,
        num_processes: int = 1,  # the launch's processes; several: the engine joins its process group
        process_index: int = 0,
        sleep: bool = False,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ):
        on_gpu = torch.cuda.is_available()
        self.hybrid = hybrid_model(model_dir)
        check_hybrid_dtype(model_dir, dtype, hybrid=self.hybrid)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: weights pushed as tensors
        if not on_gpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
        from vllm import LLM

        self.processes_per_engine = tensor_parallel_size
        self.process_index, self.num_processes = process_index, num_processes
        self.engine_index = process_index // tensor_parallel_size
        pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        launch = {"distributed_executor_backend": "external_launcher"} if num_processes > 1 else {}
        self.prefill_first = True  # hybrid models: see _prefill_first (switched off only to measure what it buys)
        hybrid = {}
        if self.hybrid:
            # A hybrid model's attention block is raised to hold a recurrent-state page (544 tokens at Qwen3.5-2B/4B,
            # 1056 on the tiny one), and a recurrent state is kept only where a prefill ends, so block-sized hits
            # alone miss every prompt shorter than a block. Prefix keys every BLOCK_SIZE tokens instead let a
            # request resume from another's state at the last 32-token boundary of that request's prompt.
            hybrid = {"prefix_match_unit": BLOCK_SIZE}
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            seed=seed + self.engine_index,  # the members of a group must agree; sampling is seeded per step anyway
            enable_prefix_caching=True,
            block_size=BLOCK_SIZE,
            enforce_eager=not on_gpu,  # CPU: starts in seconds; GPU: CUDA graphs
            limit_mm_per_prompt={"image": max_images, "video": max_videos},
            mm_processor_kwargs=pixels or None,
            disable_log_stats=False,  # the prefix-cache counters
            logprobs_mode="processed_logprobs",  # after temperature and the suppressed tokens, as the trainer's
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=sleep,
            **launch,
            **hybrid,
        )
        self.dtype = getattr(torch, dtype)
        self.sleep, self.max_images, self.max_videos = sleep, max_images, max_videos
        self.asleep = False  # put to sleep for the update (vllm_sleep), woken by the push that follows it
        # The CPU worker replaces torch.set_num_threads with a warning, which image processing then prints
        # thousands of times a step; the thread count is the engine's either way.
        logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(lambda record: "set_num_threads" not in record.getMessage())
        self.model_dir = model_dir
        if max_videos:  # refused here, at the run's start, rather than at the first step's video
            try:
                self.check_videos()
            except ValueError:
                self.close(orderly=True)  # every process of a launch fails the same check
                raise
        self._counted = self.prefix_counters()

    # ------------------------------------------------------------------------------------------------------

    def sleep_until_push(self) -> None:
        """After the step's sampling (every draw of it), before the update: with ``sleep``, free the engine's
        GPU memory, weights included (level 2): the push after the update loads them again anyway."""
        if self.sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def push_weights(self, policy: Policy) -> None:
        """Load the policy's current weights into the engine, streamed (``streamed_weights``), then drop
        everything computed with the old ones: the encoder cache (image features) and the prefix cache (KV
        blocks). Every process of a launch calls it at the same point (FSDP: the stream gathers)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # the weights' memory back; the KV cache after they are loaded
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": streamed_weights(policy, self.dtype)})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache", "scheduling"])
            self.asleep = False
        self.forget_cached()

    def check_videos(self) -> None:
        """ValueError, naming vLLM's error, where vLLM cannot read this model's videos: a blank two-frame video is
        sent through it (one greedy token; caches cleared after). vLLM 0.32's Qwen3-VL processor (Qwen3.5's is the
        same) fails so under transformers 5.25 whatever the prompt: it runs the HF processor on a text that holds a
        video placeholder and no video, which transformers now refuses ("Found 1 <|video_pad|> tokens in the text
        but no videos were passed"; docs/VLLM.md, "Video")."""
        import transformers
        import vllm
        from transformers import AutoConfig
        from vllm import SamplingParams

        config = AutoConfig.from_pretrained(self.model_dir)
        side = 2 * config.vision_config.patch_size * config.vision_config.spatial_merge_size
        blank = DecodedVideo(torch.zeros((2, 3, side, side), dtype=torch.uint8), [0, 1], total_frames=2, source_fps=2.0)
        ids = [config.vision_start_token_id, config.video_token_id, config.vision_end_token_id]  # the chat template's
        request = {"prompt_token_ids": ids, **PromptMedia([], [blank]).vllm_inputs()}
        try:
            with torch.random.fork_rng():
                self.llm.generate([request], SamplingParams(n=1, max_tokens=1, temperature=0.0), use_tqdm=False)
        except Exception as error:  # what vLLM raises differs by model and version; its first cause says the most
            cause = error.__cause__ or error
            said = " ".join(str(cause).split()).rstrip(".")  # one line
            raise ValueError(
                f"vLLM {vllm.__version__} cannot read this model's videos with transformers {transformers.__version__}"
                f" ({self.model_dir}): {type(cause).__name__}: {said}. For data with videos, use rollout.engine=hf"
                ' with this model (docs/VLLM.md, "Video")'
            ) from None
        finally:
            self.llm.reset_mm_cache()
            self.forget_cached()

    def forget_cached(self) -> None:
        """Drop what the engine computed from earlier weights: the encoder cache (image features) and the prefix
        cache (KV blocks and states)."""
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()

    def close(self, orderly: bool) -> None:
        """End the engine before the run's process group goes. ``orderly`` (every process got here): vLLM's own
        teardown, which destroys its process groups and the default one; else (this process stops alone, the
        others may wait in a collective) nothing is torn down, and vLLM's exit-time teardown is cancelled too."""
        core_client = self.llm.llm_engine.engine_core
        if orderly:
            core_client.shutdown()
        else:
            finalizer = getattr(core_client, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()

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
        """The tree of every prompt given (a group of ``processes_per_engine`` processes: the group's prompts,
        the same on each member; the run keeps each member's share)."""
        if self.asleep:
            raise RuntimeError("the vllm engine sleeps until the next push_weights; sampling now would use freed memory")
        tree = self.sample_tree(policy, samples, prompts, num_thoughts=num_thoughts, num_answers=num_answers, settings=settings)
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
        # a call ends a thought's piece too (a task with tools): the call is served and the thought goes on
        tools = ToolServer.for_rollout(policy, samples, prompts, num_thoughts, settings.max_turns)
        thought_stops = [settings.thought_stop] + ([tools.stop_text] if tools is not None else [])

        def thought_params(n: int, written: int) -> SamplingParams:
            """Sampling of a thought's next piece, ``written`` tokens already in it: a thought that has not stopped
            when only the closing tag's tokens remain gets them forced."""
            return SamplingParams(n=n, max_tokens=max(settings.max_thought_tokens - written - len(close_ids), 1), stop=thought_stops, **common)

        answer_params = SamplingParams(n=num_answers, max_tokens=settings.max_answer_tokens, stop=[settings.answer_stop], **common)
        # Decoded here, before the engine is called: a broken image or video raises ImageLoadError / VideoLoadError
        # (the trainer skips and counts the sample). The HF path's media (prompts.PromptMedia) in vLLM's form, and
        # the prompt as the HF path's processor made it with each image's and video's expansion collapsed
        # (EncodedPrompt.unexpanded_ids): vLLM expands them again, to the trainer's ids (stage 1 checks).
        media = [PromptMedia.of(policy, sample) for sample in samples]
        for kind, most in (("images", self.max_images), ("videos", self.max_videos)):
            count = max((len(getattr(m, kind)) for m in media), default=0) + (settings.max_turns if kind == "images" and tools else 0)
            if count > most:
                raise ValueError(
                    f"a prompt has {count} {kind}; the vllm engine was started for at most {most}"
                    " (the run starts it for the most any training prompt holds)"
                )
        heads = [p.unexpanded_ids for p in prompts]
        inputs = [m.vllm_inputs() for m in media]

        def request(b: int, ids: list[int]) -> dict:
            return {"prompt_token_ids": ids, **inputs[b]}

        stage1_requests = [request(b, heads[b]) for b in range(len(prompts))]
        self._prefill_first(stage1_requests)
        with _seeded(settings):
            stage1 = self.llm.generate(stage1_requests, thought_params(num_thoughts, 0), use_tqdm=False)
        thoughts = []
        for b, output in enumerate(stage1):
            self._check_expansion(output, prompts[b].input_ids, f"prompt {b}")
            thoughts += [_Thought(b, *_ids_and_logprobs(completion)) for completion in output.outputs]
            for thought, completion in zip(thoughts[-num_thoughts:], output.outputs, strict=True):
                thought.finish(completion, tools, settings, close_ids)
        if tools is not None:
            self._continue_thoughts(thoughts, tools, heads, media, thought_params, settings, close_ids, prompts)
        thought_ids = [t.ids for t in thoughts]
        thought_logprobs = [t.logprobs for t in thoughts]
        thought_forced = [t.forced for t in thoughts]
        thought_truncated = [t.truncated for t in thoughts]
        stage2_requests = [t.request(heads, media) for t in thoughts]
        self._prefill_first(stage2_requests)
        with _seeded(settings):
            stage2 = self.llm.generate(stage2_requests, answer_params, use_tqdm=False)
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
            vision_images_encoded=sum(len(m.images) + len(m.videos) for m in media) + sum(len(t.images()) for t in thoughts),
            thought_turns=[t.turns for t in thoughts],
            thought_over_turns=[t.over_turn for t in thoughts],
        )

    def _check_expansion(self, output, expected: list[int], what: str) -> None:
        if list(output.prompt_token_ids) != list(expected):
            raise RuntimeError(
                f"vLLM expanded {what} to {len(output.prompt_token_ids)} tokens, the trainer's processor to"
                f" {len(expected)}: the engine and the trainer would see different images or videos"
            )

    def _continue_thoughts(self, thoughts, tools, heads, media, thought_params, settings: SamplingSettings, close_ids, prompts) -> None:
        """Serve the calls that ended thought pieces and continue those thoughts, a round at a time, until none
        is waiting: each continuation is the prompt + the thought so far (its tool turns' images added to the
        request's images) and one sample. The prefix cache serves what an earlier round computed."""
        while True:
            waiting = [(row, t) for row, t in enumerate(thoughts) if t.waiting]
            going_on = [t for row, t in waiting if t.serve(tools.respond(row, t.ids[t.since :]), settings.max_thought_tokens, close_ids)]
            if not going_on:
                return
            requests, params = [], []
            for t in going_on:
                requests.append(t.request(heads, media))
                params.append(thought_params(1, len(t.ids)))
            with _seeded(settings):
                outputs = self.llm.generate(requests, params, use_tqdm=False)
            for t, output in zip(going_on, outputs, strict=True):
                self._check_expansion(output, prompts[t.prompt].input_ids + t.ids, f"a thought of prompt {t.prompt} after its tool turn")
                completion = output.outputs[0]
                ids, logprobs = _ids_and_logprobs(completion)
                t.extend(ids, logprobs)
                t.finish(completion, tools, settings, close_ids)

    def _prefill_first(self, requests: list[dict]) -> None:
        """Hybrid models: prefill each request once (one greedy token, discarded) before its ``n`` samples are
        asked for, so that the samples all resume from its cached state. Without it vLLM admits one new prefix a
        scheduler step: a sample whose prefix another request of the same step is computing waits for the next
        step, and admission stops at the first one that waits (the tiny model's tree: 97 engine steps instead of
        67, for ~15% fewer prefilled tokens). Outside the stage's seeded generator: the stage's draws do not move."""
        from vllm import SamplingParams

        if not (self.hybrid and self.prefill_first):
            return
        with torch.random.fork_rng():
            self.llm.generate(requests, SamplingParams(n=1, max_tokens=1, temperature=0.0), use_tqdm=False)

    # ------------------------------------------------------------------------------------------------------

    def prefix_counters(self) -> tuple[float, float]:
        """(prefix-cache hits, queried tokens) counted by the engine so far."""
        values = {metric.name: getattr(metric, "value", None) for metric in self.llm.get_metrics()}
        return float(values.get("vllm:prefix_cache_hits") or 0.0), float(values.get("vllm:prefix_cache_queries") or 0.0)

    @property
    def metrics_prefix(self) -> str | None:
        """Where this process's own figures go in a launch of several (``rollout/process3/``; the members of
        a tensor-parallel group report their one engine's hit rate)."""
        return f"rollout/process{self.process_index}/" if self.num_processes > 1 else None

    def step_metrics(self) -> dict[str, float]:
        """The prefix-cache hit rate since the last call (one step): hit tokens / queried tokens; in a launch
        also under this process's name (the run averages the plain key over the processes)."""
        hits, queries = self.prefix_counters()
        step_hits, step_queries = hits - self._counted[0], queries - self._counted[1]
        self._counted = (hits, queries)
        hit_rate = step_hits / step_queries if step_queries else 0.0
        metrics = {"rollout/prefix_cache_hit_rate": hit_rate}
        if self.metrics_prefix:
            metrics[self.metrics_prefix + "prefix_cache_hit_rate"] = hit_rate
        return metrics


class _Thought:
    """One thought being sampled by the vllm engine, piece by piece between its tool turns."""

    def __init__(self, prompt: int, ids: list[int], logprobs: list[float]):
        self.prompt, self.ids, self.logprobs = prompt, ids, logprobs
        self.forced = [False] * len(ids)
        self.turns: list = []
        self.truncated = self.over_turn = False
        self.waiting = False  # its piece ended with a call that waits to be served
        self.since = 0  # where the model's current piece starts (after its last turn)

    def extend(self, ids: list[int], logprobs: list[float]) -> None:
        self.ids, self.logprobs, self.forced = self.ids + ids, self.logprobs + logprobs, self.forced + [False] * len(ids)

    def close(self, close_ids: list[int]) -> None:
        """The thought's closing tag, forced (not sampled)."""
        self.ids, self.logprobs = self.ids + close_ids, self.logprobs + [0.0] * len(close_ids)
        self.forced = self.forced + [True] * len(close_ids)

    def finish(self, completion, tools, settings: SamplingSettings, close_ids: list[int]) -> None:
        """After a piece: closed at the token limit (truncated), waiting for its call's result, or done."""
        called = tools is not None and completion.finish_reason == "stop" and completion.stop_reason == tools.stop_text
        self.waiting = False
        if called and len(self.turns) >= settings.max_turns:
            self.over_turn = True  # one call past the bound: closed now, left out of the loss
            self.close(close_ids)
        elif called:
            self.waiting = True
        elif completion.finish_reason == "length":
            self.truncated = True
            self.close(close_ids)

    def serve(self, turn, max_thought_tokens: int, close_ids: list[int]) -> bool:
        """Place the call's result after it and return True (the thought goes on), or close the thought truncated
        when the result does not fit the budget and return False."""
        self.waiting = False
        if len(self.ids) + len(turn.ids) + len(close_ids) >= max_thought_tokens:
            self.truncated = True
            self.close(close_ids)
            return False
        self.turns.append(dataclasses.replace(turn, start=len(self.ids)))
        self.ids = self.ids + turn.ids
        self.logprobs, self.forced = self.logprobs + [0.0] * len(turn.ids), self.forced + [True] * len(turn.ids)
        self.since = len(self.ids)
        return True

    def images(self) -> list:
        return [image for turn in self.turns for image in turn.images]

    def unexpanded_ids(self) -> list[int]:
        return readable_thought_ids(self.ids, self.turns)

    def request(self, heads: list[list[int]], media: list) -> dict:
        """The prompt + this thought so far, as vLLM takes it: images unexpanded, the turns' after the prompt's."""
        inputs = media[self.prompt].vllm_inputs()
        if self.turns:
            data = dict(inputs.get("multi_modal_data", {}))
            data["image"] = list(data.get("image", [])) + self.images()
            inputs = {**inputs, "multi_modal_data": data}
        return {"prompt_token_ids": heads[self.prompt] + self.unexpanded_ids(), **inputs}


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

