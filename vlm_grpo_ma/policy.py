"""The only module that knows Qwen-VL: loading, prompts and images, tree sampling, and token log-probs.

Tree sampling (``sample_tree``): the B prompts are prefilled once (each image goes through the vision tower
once), the KV cache is repeated K times and K thoughts are decoded until ``</think>``; then the cache is
repeated M times and M answers are decoded from each thought. Prompt, image and thought are never
re-encoded for the answers, and token ids (never re-tokenised text) pass between the stages.

Position ids are computed here, not by the model. Rows finish at different steps; a finished row keeps
receiving pad tokens whose cache slots are masked out and which get no position, so the next real token of
that row sits at position (last real position + 1), exactly as in a re-encode of the row without padding.
(The model's own decode path derives positions from the cache length, which counts those pad slots: a
shorter thought would then see its answer shifted in RoPE position and get different log-probs.)
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from vlm_grpo_ma.config import SEED_STRIDE
from vlm_grpo_ma.coords import CoordinateFrame, Size
from vlm_grpo_ma.images import ImageLoadError, decode_image  # noqa: F401  (ImageLoadError: re-exported)
from vlm_grpo_ma.registry import Sample

SUPPORTED_MODEL_TYPES = {
    # model_type -> the coordinate frame that family was trained to write boxes and points in
    "qwen2_5_vl": CoordinateFrame.ABSOLUTE_INPUT,
    "qwen2_vl": CoordinateFrame.RELATIVE_1000,
    "qwen3_vl": CoordinateFrame.RELATIVE_1000,
}




def coordinate_frame_for(model_type: str) -> CoordinateFrame:
    try:
        return SUPPORTED_MODEL_TYPES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        ) from None


@dataclass
class Policy:
    """A Qwen-VL model and its processor, plus what follows from them (coordinate frame, stop ids)."""

    model: torch.nn.Module
    processor: object
    frame: CoordinateFrame
    # With LoRA: the peft wrapper of ``model`` (its LoRA layers live inside ``model``; see vlm_grpo_ma/lora.py)
    adapter: object | None = None

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> list[int]:
        ids = {self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        return sorted(i for i in ids if isinstance(i, int) and i >= 0)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_ids[0]

    @property
    def image_token_id(self) -> int:
        return self.model.config.image_token_id

    @functools.cached_property
    def suppressed_token_ids(self) -> list[int]:
        """Vision placeholder tokens: never sampled (a generated <|image_pad|> would be taken for an image slot
        by the next forward). Their logits are set to -inf both when sampling and when scoring, so sampling
        log-probs and training log-probs stay the same distribution."""
        names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")
        unk = self.tokenizer.unk_token_id
        ids = {self.tokenizer.convert_tokens_to_ids(name) for name in names}
        return sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != unk)


    def stop_candidates(self, stop_text: str) -> frozenset[int]:
        """Token ids whose text holds the stop text's last character. A stop text that was not in a row's
        text before its newest token can only appear now if that token supplies its last character, so
        only after these tokens does decoding need to look (per stop text, computed once)."""
        cache = self.__dict__.setdefault("_stop_candidates", {})
        if stop_text not in cache:
            texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
            cache[stop_text] = frozenset(i for i, text in enumerate(texts) if stop_text[-1] in text)
        return cache[stop_text]


def resolve_model_path(name_or_path: str) -> str:
    from vlm_grpo_ma.tiny import TINY_MODEL_DIR, TINY_MODEL_NAME

    return str(TINY_MODEL_DIR) if name_or_path == TINY_MODEL_NAME else name_or_path


def pick_attn_implementation(requested: str) -> str:
    """``auto``: flash_attention_2 where flash-attn is installed and CUDA is present, else sdpa."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def _checked_model_path(name_or_path: str, what: str) -> str:
    """``tiny`` -> the embedded folder; a local-looking path must exist (hub ids pass through)."""
    path = resolve_model_path(name_or_path)
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") != 1
    if looks_local and not Path(path).expanduser().exists():
        raise FileNotFoundError(
            f"{what} {name_or_path!r}: no such local folder (give a folder, a hub id like"
            " Qwen/Qwen2.5-VL-3B-Instruct, or 'tiny' for the embedded model)"
        )
    return str(Path(path).expanduser()) if looks_local else path


def load_policy(
    name_or_path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    device: torch.device | str = "cpu",
) -> Policy:
    """Load a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model (hub id or local path; ``tiny`` = the embedded one).

    A folder with ``adapter_config.json`` (a LoRA checkpoint) loads the base model it names in
    ``base_model_name_or_path``, then the adapter, trainable (resume continues training it): ``policy.model``
    is the base model with the LoRA layers inside, ``policy.adapter`` the peft wrapper.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    path = _checked_model_path(name_or_path, "model.name_or_path")
    processor_path, adapter_dir = path, None
    if (Path(path) / "adapter_config.json").is_file():
        adapter_dir = Path(path)
        base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{adapter_dir / 'adapter_config.json'} names no base_model_name_or_path")
        path = _checked_model_path(base, f"base model of the LoRA adapter {adapter_dir}:")
        if (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"the base model of {adapter_dir} is itself an adapter ({path}); merge it first")
        # a checkpoint saves the processor next to the adapter; a bare adapter folder uses the base's
        if any((adapter_dir / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
            processor_path = str(adapter_dir)
        else:
            processor_path = path
    config = AutoConfig.from_pretrained(path)
    frame = coordinate_frame_for(config.model_type)
    processor = AutoProcessor.from_pretrained(processor_path)
    if min_pixels is not None or max_pixels is not None:
        # the image processor's resize bounds (in pixels) live in size = {shortest_edge, longest_edge}
        size = dict(processor.image_processor.size)
        size["shortest_edge"] = min_pixels if min_pixels is not None else size["shortest_edge"]
        size["longest_edge"] = max_pixels if max_pixels is not None else size["longest_edge"]
        processor.image_processor.size = size
    processor.tokenizer.padding_side = "left"
    # use_kernels=False: with the `kernels` package installed (transformers >= 5.25 requires it), a model loaded
    # with the default swaps layers for Hub kernels at its first .train() on CUDA, fetching them from the Hub
    # (an offline GPU run stops there) and changing the numerics the trainer's one log-prob path is held to.
    model = AutoModelForImageTextToText.from_pretrained(
        path,
        dtype=getattr(torch, dtype),
        attn_implementation=pick_attn_implementation(attn_implementation),
        use_kernels=False,
    ).to(device)
    adapter = None
    if adapter_dir is not None:
        from peft import PeftModel

        # LoRA layers are injected into `model` in place; base weights stay frozen, the adapter trains
        adapter = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    return Policy(model=model, processor=processor, frame=frame, adapter=adapter)


# ----------------------------------------------------------------------------------------------------------
# Prompts and images


@dataclass
class EncodedPrompt:
    """One prompt, tokenised, with its images processed (still on the CPU)."""

    input_ids: list[int]
    pixel_values: torch.Tensor  # [num_patches, patch_dim]
    image_grid_thw: torch.Tensor  # [num_images, 3]
    input_sizes: tuple[Size, ...]  # (width, height) the model sees
    original_sizes: tuple[Size, ...]


def open_image(image) -> Image.Image:
    """Decoded RGB image; ImageLoadError (which callers skip) for a missing, broken or over-large one."""
    return decode_image(image)


def prompt_messages(sample: Sample, instruction: str) -> list[dict]:
    content = [{"type": "image"} for _ in sample.images]
    content.append({"type": "text", "text": f"{sample.question} {instruction}".strip()})
    return [{"role": "user", "content": content}]


def encode_prompt(policy: Policy, sample: Sample, instruction: str) -> EncodedPrompt:
    """Chat template + processor for one sample. Raises ImageLoadError for a broken or missing image, and for
    one the processor refuses."""
    images = [open_image(image) for image in sample.images]
    text = policy.processor.apply_chat_template(
        prompt_messages(sample, instruction), add_generation_prompt=True, tokenize=False
    )
    try:
        encoded = policy.processor(text=[text], images=images or None, return_tensors="pt")
    except Exception as error:
        if not images:
            raise
        # The processor has limits of its own that PIL does not know (Qwen's: an aspect ratio under 200, so a
        # 2000x8 image raises ValueError), and what it raises differs between families and versions: any
        # error on a prompt with images skips that sample, as an unreadable image does, rather than the run.
        sizes = ", ".join(f"{width}x{height}" for width, height in (image.size for image in images))
        raise ImageLoadError(
            f"sample {sample.id}: the processor refused its image(s) ({sizes}): {type(error).__name__}: {error}"
        ) from error
    if images:
        grid, pixel_values = encoded["image_grid_thw"], encoded["pixel_values"]
    else:  # a text-only prompt (math word problems, code): no vision rows
        grid = torch.zeros((0, 3), dtype=torch.long)
        pixel_values = torch.zeros((0, 0))
    patch = policy.model.config.vision_config.patch_size
    input_sizes = tuple((int(w) * patch, int(h) * patch) for _, h, w in grid.tolist())
    return EncodedPrompt(
        input_ids=encoded["input_ids"][0].tolist(),
        pixel_values=pixel_values,
        image_grid_thw=grid,
        input_sizes=input_sizes,
        original_sizes=tuple(image.size for image in images),
    )


# ----------------------------------------------------------------------------------------------------------
# Positions and the vision tower


def _rope_positions(policy: Policy, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw):
    """mRoPE position ids [3, N, L] for a padded batch (pad positions get 0)."""
    mm_token_type_ids = (input_ids == policy.image_token_id).int()
    positions, _ = policy.model.model.get_rope_index(
        input_ids,
        mm_token_type_ids,
        image_grid_thw=image_grid_thw if image_grid_thw.shape[0] else None,
        attention_mask=attention_mask,
    )
    return positions


def _encode_images(policy: Policy, prompts: Sequence[EncodedPrompt]):
    """Run the vision tower once over all images of the prompts. Returns (the model's vision output, or
    None when no prompt has an image, and the [num_images, 3] grid)."""
    device = policy.device
    grid = torch.cat([p.image_grid_thw for p in prompts]).to(device)
    if grid.shape[0] == 0:
        return None, grid
    pixel_values = torch.cat([p.pixel_values for p in prompts if p.image_grid_thw.shape[0]]).to(device)
    return policy.model.model.get_image_features(pixel_values, grid, return_dict=True), grid


@functools.lru_cache(maxsize=8)
def _blank_image_inputs(processor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of the smallest image the processor makes: a 1x1 black image, resized
    up to the processor's minimum (a few patches)."""
    encoded = processor.image_processor(images=[Image.new("RGB", (1, 1))], return_tensors="pt")
    return encoded["pixel_values"], encoded["image_grid_thw"]


def idle_vision_term(policy: Policy) -> torch.Tensor:
    """Zero, computed through the vision tower: a scored micro-batch without images computes it where the
    images would have been encoded (before the decoder: collectives must also come in the same order) and
    adds it to its log-probs.

    Under FSDP each vision block is a unit that all-gathers its parameters when it runs (and reduce-scatters
    its gradient after the backward); a process whose micro-batch has no image would skip those collectives
    while the others issue them, and the processes would abort on mismatched collectives or hang. With this
    term every process runs the tower on every training forward (a blank image of a few patches) and every
    vision parameter gets a gradient (zero from this process), under DDP too, so no parameter is ever unused.
    """
    pixel_values, grid = _blank_image_inputs(policy.processor)
    device = policy.device
    features = policy.model.model.get_image_features(pixel_values.to(device), grid.to(device), return_dict=True)
    outputs = [*features.pooler_output, *(getattr(features, "deepstack_features", None) or [])]
    return sum(_zero_of(t) for t in outputs)


def _zero_of(tensor) -> torch.Tensor:
    """0 * sum(tensor) (or of every tensor of a tuple): ties a computation into the loss's graph without
    changing any value."""
    if isinstance(tensor, (tuple, list)):
        return sum(_zero_of(t) for t in tensor)
    return tensor.sum(dtype=torch.float32) * 0.0


def _vision_inputs(vision_output) -> dict:
    """The model's image argument for features already computed (nothing for a text-only batch)."""
    return {} if vision_output is None else {"mm_encoder_outputs": {"image": vision_output}}


def _select_vision_rows(vision_output, images_per_prompt: list[int], row_prompt: list[int]):
    """Repeat the per-image vision features so that row r gets the images of prompt row_prompt[r]."""
    if vision_output is None:
        return None
    first_image = [sum(images_per_prompt[:i]) for i in range(len(images_per_prompt))]
    image_order = [first_image[p] + j for p in row_prompt for j in range(images_per_prompt[p])]
    pooled = vision_output.pooler_output
    selected = type(vision_output)(**{k: v for k, v in vision_output.items()})
    selected.pooler_output = tuple(pooled[i] for i in image_order)
    deepstack = getattr(vision_output, "deepstack_features", None)
    if deepstack:  # Qwen3-VL: one entry per level, each split per image like pooler_output
        counts = [t.shape[0] for t in pooled]
        per_image = [torch.split(lv, counts) if isinstance(lv, torch.Tensor) else lv for lv in deepstack]
        selected.deepstack_features = [tuple(level[i] for i in image_order) for level in per_image]
    return selected


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------------------
# Tree sampling


@dataclass
class TreeSample:
    """Token ids of a K x M sampling tree. Rows: thoughts are prompt-major (b * K + k), answers
    thought-major (t * M + m). ``*_logprobs`` are the sampling log-probs (at the sampling temperature)."""

    thought_ids: list[list[int]]
    thought_logprobs: list[list[float]]
    thought_forced: list[list[bool]]  # tokens the policy did not sample (the closing tag of a truncated thought)
    thought_truncated: list[bool]  # hit max_thought_tokens: "</think>" was forced
    thought_ended_turn: list[bool]  # the model ended its turn (EOS) inside the thought: no answer is possible
    answer_ids: list[list[int]]
    answer_logprobs: list[list[float]]
    answer_truncated: list[bool]
    vision_images_encoded: int = 0


@dataclass
class _DecodeState:
    cache: object
    attention_mask: torch.Tensor  # [N, L]
    next_position: torch.Tensor  # [N]
    logits: torch.Tensor  # [N, V] next-token logits of each row


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    max_thought_tokens: int = 64
    max_answer_tokens: int = 32
    thought_stop: str = "</think>"
    answer_stop: str = "</answer>"
    # One generator per prompt: prompt p's rows (its K thoughts, then its K*M answers) draw from generators[p]
    # alone, so a prompt's tree does not depend on which prompts share its batch: a run split over several
    # processes samples what a one-process run samples. None: torch's global generator.
    generators: Sequence[torch.Generator] | None = field(default=None, repr=False)


def prompt_generators(seed: int, first_prompt: int, count: int) -> list[torch.Generator]:
    """Generators of prompts ``first_prompt .. first_prompt + count - 1`` of a draw seeded by ``seed``."""
    return [torch.Generator().manual_seed(seed * SEED_STRIDE + first_prompt + p) for p in range(count)]


def _policy_logprobs(logits: torch.Tensor, temperature: float, suppressed: list[int]) -> torch.Tensor:
    """The policy's distribution: log softmax(logits / temperature) with the suppressed tokens removed.
    Used both for sampling and for training, so the two never disagree."""
    scaled = logits.float() / temperature
    if suppressed:
        scaled[..., suppressed] = float("-inf")
    return torch.log_softmax(scaled, dim=-1)


def _sample_tokens(
    logits: torch.Tensor, settings: SamplingSettings, suppressed: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens [N], their log-probs [N] under the policy's distribution).
    ``temperature == 0`` is greedy decoding (evaluation): the most likely token, its log-prob at temperature 1."""
    if settings.temperature == 0:
        logprobs = _policy_logprobs(logits, 1.0, suppressed)
        tokens = logprobs.argmax(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = _policy_logprobs(logits, settings.temperature, suppressed)  # [N, V]
    probs = logprobs.exp()
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < settings.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    if settings.generators is None:
        tokens = torch.multinomial(probs, 1).squeeze(-1)
    else:
        rows_per_prompt, leftover = divmod(probs.shape[0], len(settings.generators))
        if leftover or not rows_per_prompt:
            raise ValueError(f"{probs.shape[0]} rows cannot be split over {len(settings.generators)} prompt generators")
        # Sampled where the generator lives: on the model's device after sample_tree's _generators_on (the
        # [rows x vocab] probabilities never leave it); a CPU generator still gets them copied to the host.
        tokens = torch.cat(
            [
                torch.multinomial(rows.to(generator.device), 1, generator=generator).squeeze(-1).to(logits.device)
                for rows, generator in zip(probs.split(rows_per_prompt), settings.generators, strict=True)
            ]
        )
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _step(policy: Policy, state: _DecodeState, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Feed one token per row; ``real`` [N] bool marks rows whose token is a real one (else a masked pad)."""
    device = policy.device
    state.attention_mask = torch.cat([state.attention_mask, real.long()[:, None].to(device)], dim=1)
    positions = state.next_position[None, :, None].expand(3, -1, 1)
    out = policy.model(
        input_ids=tokens[:, None].to(device),
        attention_mask=state.attention_mask,
        position_ids=positions,
        **_cache_argument(policy.model, state.cache),
        use_cache=True,
    )
    state.next_position = state.next_position + real.long().to(device)
    return out.logits[:, -1, :]


def _decode(
    policy: Policy,
    state: _DecodeState,
    *,
    max_tokens: int,
    stop_text: str,
    forced_suffix: list[int] | None,
    settings: SamplingSettings,
):
    """Decode every row until ``stop_text`` appears in its text, an EOS, or ``max_tokens``.

    With ``forced_suffix`` (token ids), a row that has not stopped when only ``len(forced_suffix)`` tokens
    remain gets those tokens forced (not sampled), so that every row ends with the stop text.
    Leaves ``state.logits`` as the next-token logits after each row's last real token.
    """
    n = state.logits.shape[0]
    eos = set(policy.eos_token_ids)
    tokens_out: list[list[int]] = [[] for _ in range(n)]
    logprobs_out: list[list[float]] = [[] for _ in range(n)]
    forced_out: list[list[bool]] = [[] for _ in range(n)]
    truncated = [False] * n
    done = [False] * n
    pad = torch.full((n,), policy.pad_token_id, dtype=torch.long)
    final_logits = state.logits.clone()
    suffix_len = len(forced_suffix) if forced_suffix else 0
    stop_candidates = policy.stop_candidates(stop_text)
    for step in range(max_tokens):
        sampled, sampled_logprobs = _sample_tokens(state.logits, settings, policy.suppressed_token_ids)
        sampled, sampled_logprobs = sampled.cpu(), sampled_logprobs.float().cpu()
        real = torch.tensor([not d for d in done])
        tokens = torch.where(real, sampled, pad)
        # read once as Python lists: indexing a tensor element by element costs microseconds a call
        sampled_tokens, sampled_values = sampled.tolist(), sampled_logprobs.tolist()
        for row in range(n):
            if done[row]:
                continue
            forcing = forced_suffix is not None and (
                forced_out[row] and forced_out[row][-1] or step >= max_tokens - suffix_len
            )
            if forcing:
                token = forced_suffix[sum(forced_out[row])]
                tokens[row] = token
            else:
                token = sampled_tokens[row]
            tokens_out[row].append(token)
            logprobs_out[row].append(0.0 if forcing else sampled_values[row])
            forced_out[row].append(bool(forcing))
            if forcing:
                if sum(forced_out[row]) == suffix_len:
                    done[row] = truncated[row] = True
            elif token in eos or (token in stop_candidates and stop_text in policy.tokenizer.decode(tokens_out[row][-8:])):
                done[row] = True
        logits = _step(policy, state, tokens, real)
        finished_now = torch.tensor([d for d in done]) & real
        final_logits[finished_now.to(final_logits.device)] = logits[finished_now.to(logits.device)]
        state.logits = torch.where(real[:, None].to(logits.device), logits, state.logits)
        if all(done):
            break
    for row in range(n):
        if not done[row]:
            truncated[row] = True
    state.logits = torch.where(torch.tensor(done)[:, None].to(final_logits.device), final_logits, state.logits)
    return tokens_out, logprobs_out, forced_out, truncated


def decode_answers(policy: Policy, state: _DecodeState, settings: SamplingSettings):
    """Decode one answer per row of ``state`` (stop at ``settings.answer_stop``, EOS or the token limit)."""
    return _decode(
        policy,
        state,
        max_tokens=settings.max_answer_tokens,
        stop_text=settings.answer_stop,
        forced_suffix=None,
        settings=settings,
    )


def _repeat_rows(state: _DecodeState, repeats: int) -> None:
    state.cache.batch_repeat_interleave(repeats)  # in place
    state.attention_mask = state.attention_mask.repeat_interleave(repeats, dim=0)
    state.next_position = state.next_position.repeat_interleave(repeats, dim=0)
    state.logits = state.logits.repeat_interleave(repeats, dim=0)


@functools.cache
def _cache_parameter(model_class: type) -> str:
    """The name under which ``model_class.forward`` takes the KV cache: ``cache`` (transformers 5.20 on) or
    ``past_key_values`` (earlier). A wrong name is swallowed by ``**kwargs`` without an error: the model then
    decodes every token without the cache, and sampling produces garbage."""
    import inspect

    parameters = inspect.signature(model_class.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(f"{model_class.__name__}.forward takes neither cache= nor past_key_values=; unsupported transformers version")


def _cache_argument(model: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for ``model``'s forward (see ``_cache_parameter``)."""
    return {_cache_parameter(type(model)): cache}


def _sampling_cache(policy: Policy, capacity: int | None):
    """A KV cache for decoding: with ``capacity`` (the longest sequence the rollout can reach) every layer
    writes into a buffer allocated once (``_preallocated_layer_class``) instead of growing by ``torch.cat`` at every
    token, which copies the whole cache each step. Models whose layers are not plain dynamic ones (sliding
    windows) keep transformers' own."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=policy.model.config)
    if capacity is not None and cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        layer_class = _preallocated_layer_class()
        cache.layers = [layer_class(capacity) for _ in cache.layers]
    return cache


@functools.cache
def _preallocated_layer_class():
    """The class, built on first use (transformers is imported lazily in this module)."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are views of the first ``length`` slots of buffers of
        ``capacity`` slots: an update copies only the new tokens. A sequence past the capacity doubles it."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity, self.length = capacity, 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._buffers = [x.new_empty((*x.shape[:-2], max(self.capacity, x.shape[-2]), x.shape[-1])) for x in (key_states, value_states)]
            end = self.length + key_states.shape[-2]
            if end > self._buffers[0].shape[-2]:  # past the planned length: grow (not expected in a rollout)
                self._buffers = [torch.cat([b, torch.empty_like(b)], dim=-2) for b in self._buffers]
            self._buffers[0][..., self.length : end, :] = key_states
            self._buffers[1][..., self.length : end, :] = value_states
            self.length = end
            self._views()
            return self.keys, self.values

        def _views(self) -> None:
            self.keys, self.values = (b[..., : self.length, :] for b in self._buffers)

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.length:
                self._buffers = [b.repeat_interleave(repeats, dim=0) for b in self._buffers]
                self._views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.length:
                self._buffers = [b[indices, ...] for b in self._buffers]
                self._views()

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            self.batch_select_indices(beam_idx.to(self._buffers[0].device))

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("the sampling cache is never cropped")

    return PreallocatedLayer


def prefill(
    policy: Policy, ids: torch.Tensor, mask: torch.Tensor, grid: torch.Tensor, *, capacity: int | None = None, **vision_inputs
) -> _DecodeState:
    """Run left-padded prompts [N, L] through the model once, into a fresh KV cache (preallocated for
    ``capacity`` tokens per row when given). ``vision_inputs`` are the model's image arguments:
    ``mm_encoder_outputs`` (features already computed) or ``pixel_values`` + ``image_grid_thw``."""
    positions = _rope_positions(policy, ids, mask, grid)
    out = policy.model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **_cache_argument(policy.model, _sampling_cache(policy, capacity)),
        use_cache=True,
        logits_to_keep=1,
        **vision_inputs,
    )
    return _DecodeState(
        cache=out.cache if hasattr(out, "cache") else out.past_key_values,
        attention_mask=mask,
        next_position=positions.amax(dim=(0, 2)) + 1,  # [N]
        logits=out.logits[:, -1, :],
    )


def _generators_on(settings: SamplingSettings, device: torch.device) -> SamplingSettings:
    """``settings`` with its per-prompt generators on ``device``, so that sampling stays on the model's
    device (at Qwen's 151,936-token vocabulary, copying 128 rows of probabilities to the host is 78 MB per
    decoded token). Each device generator is seeded by one draw from its prompt's CPU generator: a prompt's
    tree stays a function of (seed, step, prompt), whichever process samples it. On the CPU: unchanged."""
    if settings.generators is None or device.type == "cpu":
        return settings
    seeds = [int(torch.randint(2**62, (), generator=g)) if g.device.type == "cpu" else None for g in settings.generators]
    moved = [g if seed is None else torch.Generator(device=device).manual_seed(seed) for g, seed in zip(settings.generators, seeds, strict=True)]
    return dataclasses.replace(settings, generators=moved)


@torch.no_grad()
def sample_tree(
    policy: Policy,
    prompts: Sequence[EncodedPrompt],
    *,
    num_thoughts: int,
    num_answers: int,
    settings: SamplingSettings,
) -> TreeSample:
    """K thoughts per prompt, then M answers per thought from the thought's KV cache."""
    device = policy.device
    settings = _generators_on(settings, device)
    ids, mask = _left_pad([p.input_ids for p in prompts], policy.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    vision, grid = _encode_images(policy, prompts)
    # every row's longest possible sequence: prompt, thought, answer (the cache never grows by concatenation)
    capacity = ids.shape[1] + settings.max_thought_tokens + settings.max_answer_tokens
    state = prefill(policy, ids, mask, grid, capacity=capacity, **_vision_inputs(vision))
    _repeat_rows(state, num_thoughts)
    close_ids = policy.tokenizer.encode(settings.thought_stop, add_special_tokens=False)
    thought_ids, thought_logprobs, thought_forced, thought_truncated = _decode(
        policy,
        state,
        max_tokens=settings.max_thought_tokens,
        stop_text=settings.thought_stop,
        forced_suffix=close_ids,
        settings=settings,
    )
    _repeat_rows(state, num_answers)
    answer_ids, answer_logprobs, _, answer_truncated = decode_answers(policy, state, settings)
    return TreeSample(
        thought_ids=thought_ids,
        thought_logprobs=thought_logprobs,
        thought_forced=thought_forced,
        thought_truncated=thought_truncated,
        thought_ended_turn=[bool(ids) and ids[-1] in policy.eos_token_ids for ids in thought_ids],
        answer_ids=answer_ids,
        answer_logprobs=answer_logprobs,
        answer_truncated=answer_truncated,
        vision_images_encoded=int(grid.shape[0]),
    )


# ----------------------------------------------------------------------------------------------------------
# Log-probs of given sequences (training forward)


class CompletionScorer(torch.nn.Module):
    """Log-probs of training rows as one module call: data-parallel wrappers (DDP through
    ``accelerator.prepare``, FSDP2's root unit) see the whole forward, vision tower included, and synchronise
    its gradients."""

    def __init__(self, policy: Policy, *, share_prefixes: bool):
        super().__init__()
        self.model = policy.model  # registers the parameters; the policy object itself is not a module
        self._policy = policy
        self.share_prefixes = share_prefixes

    def forward(self, prompts, row_prompt, completions, thought_lengths, *, temperature: float) -> torch.Tensor:
        """Log-probs [N, T] of training rows (a thought + answer after prompt ``row_prompt[r]``): through the KV
        cache, each prompt and thought encoded once (``shared_prefix_logprobs``), or with ``share_prefixes``
        off (gradient checkpointing drops the cache) by re-encoding every row (``sequence_logprobs``). The two
        agree."""
        if self.share_prefixes:
            return shared_prefix_logprobs(self._policy, prompts, row_prompt, completions, thought_lengths, temperature=temperature)
        return sequence_logprobs(self._policy, prompts, row_prompt, completions, temperature=temperature)


def sequence_logprobs(
    policy: Policy,
    prompts: Sequence[EncodedPrompt],
    row_prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
) -> torch.Tensor:
    """Log-probs of each row's completion tokens given its prompt: rows are prompt ``row_prompt[r]`` followed
    by ``completions[r]``. Images are encoded once per prompt and shared by the rows (gradients flow back to
    the vision tower). Returns [N, T] (T = longest completion; padding positions hold 0).
    """
    device = policy.device
    width_prompt = [len(prompts[p].input_ids) for p in row_prompt]
    lengths = [len(c) for c in completions]
    n = len(completions)
    # right padding: every row starts at position 0
    ids, mask = _right_pad([prompts[p].input_ids + list(c) for p, c in zip(row_prompt, completions, strict=True)], policy.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    used = sorted(set(row_prompt))
    vision, _ = _encode_images(policy, [prompts[p] for p in used])
    # no image in this micro-batch: the tower runs anyway, where it would have run (see idle_vision_term)
    idle_vision = idle_vision_term(policy) if vision is None else None
    images_per_prompt = [prompts[p].image_grid_thw.shape[0] for p in used]
    row_vision = _select_vision_rows(vision, images_per_prompt, [used.index(p) for p in row_prompt])
    grid = torch.cat([prompts[p].image_grid_thw for p in row_prompt]).to(device)
    positions = _rope_positions(policy, ids, mask, grid)
    hidden = policy.model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, **_vision_inputs(row_vision)
    ).last_hidden_state  # [N, L, H]
    longest = max(lengths) if lengths else 0
    # Hidden states that predict completion token j of row r sit at position width_prompt[r] - 1 + j.
    gather_at = torch.zeros((n, longest), dtype=torch.long)
    valid = torch.zeros((n, longest), dtype=torch.bool)
    for r in range(n):
        gather_at[r, : lengths[r]] = torch.arange(lengths[r]) + width_prompt[r] - 1
        valid[r, : lengths[r]] = True
    gather_at, valid = gather_at.to(device), valid.to(device)
    picked = hidden.gather(1, gather_at[..., None].expand(-1, -1, hidden.shape[-1]))  # [N, T, H]
    targets, _ = _right_pad(completions, 0)
    # the head runs at completion positions only: no [N, L, V] logits
    logprobs = _token_logprobs(policy, picked, targets, temperature)
    if idle_vision is not None:
        logprobs = logprobs + idle_vision
    return logprobs.masked_fill(~valid, 0.0)


def _continue_block(policy: Policy, cache, mask: torch.Tensor, next_position: torch.Tensor, rows: Sequence[Sequence[int]]):
    """Feed one right-padded block of tokens per row after what ``cache`` holds (it grows in place).
    ``mask`` [N, L] is the cache's attention mask, ``next_position`` [N] each row's next text position.
    Returns (hidden states [N, max(W, 1), H], the mask extended to [N, L + max(W, 1)]); W = 0 feeds one
    masked pad column."""
    device = policy.device
    ids, block_mask = _right_pad(rows, policy.pad_token_id)
    if ids.shape[1] == 0:
        # Every row's block is empty (one-token answers, empty thoughts): the decoder still runs, on one masked
        # pad column, because under FSDP each layer's forward all-gathers its parameters and every process must
        # issue the same collectives whatever its rows hold. Callers read only the first W hidden states of a
        # block; shared_prefix_logprobs ties the rest into the result with weight 0 (the same backward too).
        ids = torch.full((len(rows), 1), policy.pad_token_id, dtype=torch.long)
        block_mask = torch.zeros((len(rows), 1), dtype=torch.long)
    ids, block_mask = ids.to(device), block_mask.to(device)
    mask = torch.cat([mask, block_mask], dim=1)
    # text after the image: the three mRoPE components are equal
    positions = (next_position[:, None] + torch.arange(ids.shape[1], device=device)[None, :])[None].expand(3, -1, -1)
    hidden = policy.model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
        **_cache_argument(policy.model.model, cache),
    ).last_hidden_state
    return hidden, mask


def shared_prefix_logprobs(
    policy: Policy,
    prompts: Sequence[EncodedPrompt],
    row_prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    thought_lengths: Sequence[int],
    *,
    temperature: float,
) -> torch.Tensor:
    """What ``sequence_logprobs`` returns, computed the way the rollout samples: each prompt once, each
    distinct thought once on its prompt's KV cache, each answer on its thought's cache. Row r's completion is
    the thought ``completions[r][:thought_lengths[r]]`` followed by its answer; rows with the same prompt and
    thought share that computation, and gradients flow back through the cache into it.

    Re-encoding rows instead encodes a prompt (its image tokens included) K*M times and each thought M times;
    with the embedded model's T4A4 rows that is about 5x the tokens. transformers drops the cache under
    gradient checkpointing, so that setting re-encodes (``CompletionScorer``).
    """
    from transformers import DynamicCache

    device = policy.device
    keys = [(p, tuple(c[:t])) for p, c, t in zip(row_prompt, completions, thought_lengths, strict=True)]
    thought_index = {key: i for i, key in enumerate(dict.fromkeys(keys))}  # distinct (prompt, thought) pairs
    thought_keys = list(thought_index)
    thought_of_row = [thought_index[key] for key in keys]
    used = list(dict.fromkeys(row_prompt))  # distinct prompts
    prompt_of_thought = [used.index(p) for p, _ in thought_keys]
    thoughts = [list(thought) for _, thought in thought_keys]
    answers = [list(c[t:]) for c, t in zip(completions, thought_lengths, strict=True)]

    # 1. The distinct prompts, right-padded: every attention row keeps a real key (left padding would leave
    # fully masked rows, whose NaN-prone softmax would now sit on the backward path).
    ids, mask = _right_pad([prompts[p].input_ids for p in used], policy.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    vision, grid = _encode_images(policy, [prompts[p] for p in used])
    # no image in this micro-batch: the tower runs anyway, where it would have run (see idle_vision_term)
    idle_vision = idle_vision_term(policy) if vision is None else None
    positions = _rope_positions(policy, ids, mask, grid)
    cache = DynamicCache(config=policy.model.config)
    prompt_hidden = policy.model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
        **_cache_argument(policy.model.model, cache), **_vision_inputs(vision),
    ).last_hidden_state  # fmt: skip
    prompt_last = prompt_hidden[torch.arange(len(used), device=device), mask.sum(1) - 1]  # [U, H]
    next_position = positions.masked_fill(mask[None] == 0, -1).amax(dim=(0, 2)) + 1  # [U]

    # 2. Each distinct thought on its prompt's cache.
    select = torch.tensor(prompt_of_thought, device=device)
    cache.reorder_cache(select)  # index_select: differentiable, gradients of all K thoughts add up in the prompt
    thought_hidden, mask = _continue_block(policy, cache, mask[select], next_position[select], thoughts)
    thought_length = torch.tensor([len(t) for t in thoughts], device=device)
    next_position = next_position[select] + thought_length

    # 3. Each answer on its thought's cache, without its last token (whose output predicts nothing scored).
    select = torch.tensor(thought_of_row, device=device)
    cache.reorder_cache(select)
    answer_hidden, _ = _continue_block(policy, cache, mask[select], next_position[select], [a[:-1] for a in answers])

    # The hidden state that predicts each scored token: thought token 0 <- the prompt's last position, thought
    # token j <- thought position j - 1, answer token 0 <- the thought's last position (the prompt's for an
    # empty thought), answer token j <- answer position j - 1.
    before_thought = torch.cat([prompt_last[prompt_of_thought][:, None], thought_hidden], dim=1)  # [Tn, Wt + 1, H]
    thought_end = before_thought[torch.arange(len(thoughts), device=device), thought_length]  # [Tn, H]
    before_answer = torch.cat([thought_end[select][:, None], answer_hidden], dim=1)  # [N, Wa, H]
    thought_targets, _ = _right_pad(thoughts, 0)
    answer_targets, _ = _right_pad(answers, 0)
    thought_logprobs = _token_logprobs(policy, before_thought[:, : thought_targets.shape[1]], thought_targets, temperature)
    answer_logprobs = _token_logprobs(policy, before_answer[:, : answer_targets.shape[1]], answer_targets, temperature)

    # Back to one row per answer, as sequence_logprobs lays them out: thought, answer, zero padding.
    width = max((len(c) for c in completions), default=0)
    rows = []
    for r, (t, answer) in enumerate(zip(thought_lengths, answers, strict=True)):
        padding = answer_logprobs.new_zeros(width - t - len(answer))
        rows.append(torch.cat([thought_logprobs[thought_of_row[r], :t], answer_logprobs[r, : len(answer)], padding]))
    if not rows:
        return torch.zeros((0, width), device=device)
    # Every pass's output is part of the result, whatever the rows hold, so that every process runs the same
    # backward (FSDP gathers and reduces per layer use): the pad columns of empty blocks, and the vision tower
    # on a micro-batch without images (idle_vision_term), enter with weight 0.
    unused = _zero_of(thought_hidden) + _zero_of(answer_hidden)
    if idle_vision is not None:
        unused = unused + idle_vision
    return torch.stack(rows) + unused


def _token_logprobs(policy: Policy, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs [N, T] of ``targets`` [N, T] under the policy, from the hidden states [N, T, H] predicting them.

    ``hidden`` is made contiguous first: a sliced [N, T, H] that requires grad, against a frozen head (LoRA, a
    frozen tied embedding), makes matmul copy the [H, V] weight N times for a batched product (at Qwen2-VL-2B's
    151,936 x 1,536 with 2 thought rows: 0.93 GB and a quarter of the CPU forward's time)."""
    logprobs = _policy_logprobs(policy.model.lm_head(hidden.contiguous()), temperature, policy.suppressed_token_ids)
    return logprobs.gather(-1, targets.to(hidden.device)[..., None]).squeeze(-1)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

