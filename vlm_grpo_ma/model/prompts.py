"""Prompts, images and videos: one sample through the chat template and the processor (``EncodedPrompt``), and
the model inputs that sampling and scoring share: mRoPE positions of a padded batch (video frames at their time
positions), the vision tower run once per forward over every image and video, and padding."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image

from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.task_api.coords import Size
from vlm_grpo_ma.task_api.images import ImageLoadError, decode_image
from vlm_grpo_ma.task_api.registry import Sample, task_tools
from vlm_grpo_ma.task_api.videos import DecodedVideo, VideoLoadError, decode_video


def _no_grid() -> torch.Tensor:
    return torch.zeros((0, 3), dtype=torch.long)


@dataclass
class EncodedPrompt:
    """One prompt, tokenised, with its images and videos processed (still on the CPU)."""

    input_ids: list[int]
    # input_ids with each image's and each video's expansion (placeholders, and Qwen3-VL's frame timestamps and
    # per-frame vision markers) collapsed to its one placeholder token: the form vLLM expands itself
    unexpanded_ids: list[int]
    pixel_values: torch.Tensor  # [num_patches, patch_dim]
    image_grid_thw: torch.Tensor  # [num_images, 3]
    input_sizes: tuple[Size, ...]  # (width, height) the model sees
    original_sizes: tuple[Size, ...]
    pixel_values_videos: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 0)))  # [num_patches, patch_dim]
    video_grid_thw: torch.Tensor = field(default_factory=_no_grid)  # [num_videos, 3]: temporal patches, height, width
    # Seconds between a video's temporal patches (temporal_patch_size / sampled fps): Qwen2.5-VL's time positions
    video_seconds_per_grid: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    video_frames: tuple[int, ...] = ()  # frames the model sees, per video


@dataclass
class VisionGrids:
    """The grids of a batch's images and videos, each in the order their placeholders appear, row by row, and
    each video's seconds per temporal patch."""

    image: torch.Tensor  # [num_images, 3]
    video: torch.Tensor  # [num_videos, 3]
    video_seconds: torch.Tensor  # [num_videos]

    @classmethod
    def of(cls, prompts: Sequence[EncodedPrompt]) -> VisionGrids:
        """The grids of ``prompts`` (one per row, repeats allowed), in row order."""
        return cls(
            image=torch.cat([_no_grid(), *(p.image_grid_thw for p in prompts)]),
            video=torch.cat([_no_grid(), *(p.video_grid_thw for p in prompts)]),
            video_seconds=torch.cat([torch.zeros(0), *(p.video_seconds_per_grid.float() for p in prompts)]),
        )

    @property
    def count(self) -> int:
        """Images and videos in the batch."""
        return self.image.shape[0] + self.video.shape[0]

    def to(self, device) -> VisionGrids:
        return VisionGrids(self.image.to(device), self.video.to(device), self.video_seconds.to(device))


def open_image(image) -> Image.Image:
    """Decoded RGB image; ImageLoadError (which callers skip) for a missing, broken or over-large one."""
    return decode_image(image)


def prompt_messages(sample: Sample, instruction: str) -> list[dict]:
    content = [{"type": "image"} for _ in sample.images] + [{"type": "video"} for _ in sample.videos]
    content.append({"type": "text", "text": f"{sample.question} {instruction}".strip()})
    return [{"role": "user", "content": content}]


# What a thinking model's chat template (Qwen3.5, Qwen3-VL-Thinking) appends to the generation prompt to open
# the thought for the model.
OPENED_THOUGHT = "<think>"


def generation_prompt(policy: Policy, sample: Sample, instruction: str, tools: Sequence = ()) -> str:
    """The chat template's text for one sample, ending where the model starts to write. A template that opens
    the thought itself (``<|im_start|>assistant\\n<think>\\n``) has that tag taken back: the tasks ask for the
    whole ``<think>...</think><answer>...</answer>`` and score its format, so on every family the completion,
    tags included, is the model's. ``tools`` (``task_api.tools.Tool``) are declared the way the template declares
    tools (Qwen's: in the system turn, with the call format)."""
    declared = {"tools": [tool.schema() for tool in tools]} if tools else {}
    text = policy.processor.apply_chat_template(
        prompt_messages(sample, instruction), add_generation_prompt=True, tokenize=False, **declared
    )
    return _without_opened_thought(text)


def _without_opened_thought(text: str) -> str:
    stripped = text.rstrip()
    return stripped[: -len(OPENED_THOUGHT)] if stripped.endswith(OPENED_THOUGHT) else text


# The video processor's settings for frames already chosen and sized (``task_api.videos``): no sampling or resizing
# of its own. Scoped to the video processor: a bare do_resize=False would reach the images too.
VIDEO_PROCESSOR_SETTINGS = {"do_sample_frames": False, "do_resize": False}


@dataclass
class PromptMedia:
    """A sample's images and videos, decoded, in the form each consumer takes them: the HF processor's arguments
    (``processor_inputs``, the trainer's prompt) and a vLLM request's (``vllm_inputs``; vLLM runs the same HF
    processor on them). Both get the same frames and the same metadata (the source's frame count and fps and the
    chosen frames' indices, from which the processor times the frames: Qwen2.5-VL's seconds per temporal patch,
    Qwen3-VL's timestamps in the text), so the engine and the trainer see the same video."""

    images: list[Image.Image]
    videos: list[DecodedVideo]

    @classmethod
    def of(cls, policy: Policy, sample: Sample) -> PromptMedia:
        """Decoded: ImageLoadError for a broken or missing image, VideoLoadError (an ImageLoadError) for a video."""
        return cls(
            [open_image(image) for image in sample.images],
            [decode_video(video, policy.video_budget, factor=policy.patch_factor) for video in sample.videos],
        )

    def processor_inputs(self) -> dict:
        """The HF processor's image and video arguments."""
        inputs = {"images": self.images or None}
        if self.videos:
            from transformers.video_utils import VideoMetadata

            inputs["videos"] = [v.frames for v in self.videos]
            metadata = [VideoMetadata(**v.metadata) for v in self.videos]
            inputs["videos_kwargs"] = {"video_metadata": metadata, **VIDEO_PROCESSOR_SETTINGS}
        return inputs

    def vllm_inputs(self) -> dict:
        """A vLLM request's ``multi_modal_data`` and ``mm_processor_kwargs`` (nothing for a text-only prompt). A video
        goes as vLLM's Qwen-VL processors take pre-sampled frames: (uint8 frames [T, H, W, 3], metadata), with
        ``do_sample_frames`` False in the metadata (Qwen3-VL reads it there; Qwen2.5-VL drops it and reads
        ``mm_processor_kwargs``)."""
        data = {}
        if self.images:
            data["image"] = self.images
        if self.videos:
            data["video"] = [
                (v.frames.permute(0, 2, 3, 1).contiguous().numpy(),
                 {**v.metadata, "duration": v.total_frames / v.source_fps, "video_backend": "pyav", "do_sample_frames": False})
                for v in self.videos
            ]  # fmt: skip
        if not data:
            return {}
        extra = {"mm_processor_kwargs": {"videos_kwargs": dict(VIDEO_PROCESSOR_SETTINGS)}} if self.videos else {}
        return {"multi_modal_data": data, **extra}


def _unexpanded_ids(policy: Policy, encoded) -> list[int]:
    """The processor's ids with each image's and video's replacement collapsed to its one placeholder token: the
    prompt vLLM expands itself. Where each replacement lies is the processor's own account
    (``text_replacement_offsets``, character spans in the expanded text, and the tokens' ``offset_mapping``), not a
    guess from the ids: Qwen3-VL's video replacement is "<t seconds>" text and a <|vision_start|>...<|vision_end|>
    pair per temporal patch (in place of the chat template's <|vision_start|><|video_pad|><|vision_end|>), and
    vLLM 0.32 with transformers >= 5.10 writes that whole replacement for one bare <|video_pad|>; Qwen2-VL's and
    Qwen2.5-VL's replacements, and every image's, are runs of the placeholder, inside the template's markers."""
    placeholder = {"image": policy.image_token_id, "video": policy.video_token_id}
    spans = [(*item["new_span"], placeholder[item["type"]]) for item in encoded["text_replacement_offsets"][0]]
    ids: list[int] = []
    for token, (start, _) in zip(encoded["input_ids"][0].tolist(), encoded["offset_mapping"][0].tolist(), strict=True):
        span = next((s for s in spans if s[0] <= start < s[1]), None)
        if span is None:
            ids.append(token)
        elif start == span[0]:  # the replacement's first token stands for the whole of it
            ids.append(span[2])
    return ids


def encode_prompt(policy: Policy, sample: Sample, instruction: str) -> EncodedPrompt:
    """Chat template + processor for one sample: the expanded ids the trainer scores and the unexpanded ones the
    vLLM engine sends, from one processor call. Raises ImageLoadError for a broken or missing image, and for one
    the processor refuses; VideoLoadError (an ImageLoadError) for such a video."""
    media = PromptMedia.of(policy, sample)
    images, videos = media.images, media.videos
    text = generation_prompt(policy, sample, instruction, task_tools(sample.task))
    try:
        encoded = policy.processor(
            text=[text], return_tensors="pt", return_text_replacement_offsets=True, return_offsets_mapping=True,
            **media.processor_inputs(),
        )  # fmt: skip
    except Exception as error:
        if not images and not videos:
            raise
        # The processor has limits of its own that PIL does not know (Qwen's: an aspect ratio under 200, so a
        # 2000x8 image raises ValueError), and what it raises differs between families and versions: any
        # error on a prompt with images or videos skips that sample, as an unreadable image does, rather than
        # the run.
        sizes = ", ".join(f"{width}x{height}" for width, height in (image.size for image in images))
        sizes += "".join(f", video of {v.frames.shape[0]} frames of {v.frames.shape[-1]}x{v.frames.shape[-2]}" for v in videos)
        error_type = VideoLoadError if videos else ImageLoadError
        raise error_type(
            f"sample {sample.id}: the processor refused its inputs ({sizes.lstrip(', ')}): {type(error).__name__}: {error}"
        ) from error
    if images:
        grid, pixel_values = encoded["image_grid_thw"], encoded["pixel_values"]
    else:  # a prompt without images (text-only: math word problems, code; or videos only): no image rows
        grid = _no_grid()
        pixel_values = torch.zeros((0, 0))
    patch = policy.model.config.vision_config.patch_size
    input_sizes = tuple((int(w) * patch, int(h) * patch) for _, h, w in grid.tolist())
    video_fields = {}
    if videos:
        # Qwen2.5-VL's processor gives the seconds per temporal patch; the other families' time comes from the text
        # (Qwen3-VL) or is one per patch (Qwen2-VL), and the same figure is kept for them (their models ignore it)
        temporal_patch = policy.processor.video_processor.temporal_patch_size
        seconds = encoded.get("second_per_grid_ts", [temporal_patch / v.sampled_fps for v in videos])
        video_fields = dict(
            pixel_values_videos=encoded["pixel_values_videos"],
            video_grid_thw=encoded["video_grid_thw"],
            video_seconds_per_grid=torch.as_tensor(seconds, dtype=torch.float32).reshape(len(videos)),
            video_frames=tuple(int(v.frames.shape[0]) for v in videos),
        )
    return EncodedPrompt(
        input_ids=encoded["input_ids"][0].tolist(),
        unexpanded_ids=_unexpanded_ids(policy, encoded),
        pixel_values=pixel_values,
        image_grid_thw=grid,
        input_sizes=input_sizes,
        original_sizes=tuple(image.size for image in images),
        **video_fields,
    )


# ----------------------------------------------------------------------------------------------------------
# Tool turns: a tool's result as the tokens the model reads after its call


@dataclass
class ToolTurn:
    """One tool result inside a thought: the tokens from the end of the model's call to the model's next token
    (its turn closed, the result's turn with any images, a new assistant turn opened), rendered by the chat
    template. None of them is the model's: they are context, with weight 0 in the loss."""

    ids: list[int]  # expanded: each image's placeholder repeated over its vision tokens
    unexpanded_ids: list[int]  # each image one placeholder (vLLM expands it)
    pixel_values: torch.Tensor  # [num_patches, patch_dim] of the turn's images
    image_grid_thw: torch.Tensor  # [num_images, 3]
    images: tuple = ()  # the images (PIL) as the tool returned them: what the vLLM engine sends
    error: bool = False  # the call could not be served; the text says why
    boxes: tuple = ()  # where each image came from (task_api.tools.ToolResult.boxes)
    start: int = 0  # the turn's first token's index in the thought

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


# Stands for the model's own turn while the template renders the result after it; never reaches the model
_CALL_STAND_IN = "\u2063CALL\u2063"


def tool_turn_text(policy: Policy, result_text: str, num_images: int) -> str:
    """The chat template's text between the model's call and its next token: the template renders a stand-in
    assistant turn followed by the result's ``tool`` turn and the generation prompt, and the text after the
    stand-in is taken. A template that opens the thought itself has that tag taken back (``generation_prompt``)."""
    content = [{"type": "image"} for _ in range(num_images)] + ([{"type": "text", "text": result_text}] if result_text else [])
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "?"}]},
        {"role": "assistant", "content": _CALL_STAND_IN},
        {"role": "tool", "content": content or [{"type": "text", "text": ""}]},
    ]
    text = policy.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return _without_opened_thought(text[text.index(_CALL_STAND_IN) + len(_CALL_STAND_IN) :])


def encode_tool_turn(policy: Policy, result) -> ToolTurn:
    """A ``task_api.tools.ToolResult`` as a ``ToolTurn``: its images through the processor (resized under the image
    budget as a prompt's are). An image the processor refuses becomes an error turn."""
    images = list(result.images)
    text = tool_turn_text(policy, result.text, len(images))
    try:
        encoded = policy.processor(
            text=[text], images=images or None, return_tensors="pt", return_text_replacement_offsets=True,
            return_offsets_mapping=True,
        )  # fmt: skip
    except Exception:  # the processor's own limits (aspect ratio, size): the model reads why instead
        if not images:
            raise
        from vlm_grpo_ma.task_api.tools import ToolResult

        return encode_tool_turn(policy, ToolResult(text="Error: the region could not be shown", error=True))
    grid = encoded["image_grid_thw"] if images else _no_grid()
    return ToolTurn(
        ids=encoded["input_ids"][0].tolist(),
        unexpanded_ids=_unexpanded_ids(policy, encoded),
        pixel_values=encoded["pixel_values"] if images else torch.zeros((0, 0)),
        image_grid_thw=grid,
        images=tuple(images),
        error=bool(result.error),
        boxes=tuple(result.boxes),
    )


def continued_positions(
    policy: Policy, ids: torch.Tensor, mask: torch.Tensor, image_grid: torch.Tensor, start: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """mRoPE positions [3, N, W] of a right-padded block [N, W] that continues each row after position
    ``start[r] - 1``, and each row's next position [N]. Text continues one by one (the three components equal);
    a block holding images (``image_grid``: its images' grids in row order) gets their 3D positions as a re-encode
    of the whole sequence would, the text after an image at its largest position + 1 (Qwen's rule, as in
    ``_rope_positions``: a block's positions from 0, shifted by ``start``)."""
    device = ids.device
    width = ids.shape[1]
    positions = (start[:, None] + torch.arange(width, device=device)[None, :])[None].expand(3, -1, -1).clone()
    with_images = (ids == policy.image_token_id).any(dim=1)
    if bool(with_images.any()):
        rows = with_images.nonzero().squeeze(1)
        grids = VisionGrids(image_grid.to(device), _no_grid().to(device), torch.zeros(0, device=device))
        local = _rope_positions(policy, ids[rows], mask[rows], grids)
        positions[:, rows] = local + start[rows][None, :, None]
    real = mask.bool()
    last = positions.masked_fill(~real[None], -1).amax(dim=(0, 2)) + 1  # [N]; a row without tokens: 0
    next_start = torch.where(real.any(dim=1), last, start)
    return positions, next_start


# ----------------------------------------------------------------------------------------------------------
# Positions and the vision tower


def _rope_positions(policy: Policy, input_ids: torch.Tensor, attention_mask: torch.Tensor, grids: VisionGrids):
    """mRoPE position ids [3, N, L] for a padded batch (pad positions get 0). Image tokens are type 1, video
    tokens type 2: a video's temporal patches get time positions (Qwen2.5-VL: spaced by its seconds per
    patch), an image's all share one. The text after a video starts at the video's largest position + 1
    (``text_after_video_positions``)."""
    token_types = (input_ids == policy.image_token_id).int() + 2 * (input_ids == policy.video_token_id).int()
    videos = {}
    if grids.video.shape[0]:
        videos = {"video_grid_thw": grids.video, "second_per_grid_ts": grids.video_seconds}
    positions, _ = policy.model.model.get_rope_index(
        input_ids,
        token_types,
        image_grid_thw=grids.image if grids.image.shape[0] else None,
        attention_mask=attention_mask,
        **videos,
    )
    if grids.video.shape[0]:
        positions = text_after_video_positions(positions, token_types, attention_mask)
    return positions


VIDEO_TOKEN_TYPE = 2


def text_after_video_positions(positions: torch.Tensor, token_types: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``positions`` [3, N, L] with everything after each video moved up so that the next token sits at the
    video's largest position (over its three components) + 1.

    That is where Qwen's reference code, which the Qwen2-VL and Qwen2.5-VL checkpoints were trained with, and
    vLLM put it. transformers >= 5.3 (5.25 here; huggingface/transformers#45381) puts it at the video's start
    + max(h, w) / merge, its spatial extent only: when the video's time span is longer (more temporal patches,
    or Qwen2.5-VL's seconds per patch x tokens_per_second), the text after it reuses positions inside the
    video's time range. Images, and Qwen3-VL's and Qwen3.5's videos (one temporal patch per frame, timestamps
    in the text), are not moved."""
    positions = positions.clone()
    for row in range(positions.shape[1]):
        real = attention_mask[row].bool()
        types = token_types[row][real].tolist()
        if VIDEO_TOKEN_TYPE not in types:
            continue
        row_positions = positions[:, row, real]  # [3, real length], a copy
        shift, start = 0, 0
        while start < len(types):
            end = start
            while end < len(types) and types[end] == types[start]:
                end += 1
            row_positions[:, start:end] += shift
            if types[start] == VIDEO_TOKEN_TYPE and end < len(types):
                following = int(row_positions[0, end]) + shift  # where transformers starts what follows
                shift += max(0, int(row_positions[:, start:end].max()) + 1 - following)
            start = end
        positions[:, row, real] = row_positions
    return positions


def _encode_images(policy: Policy, prompts: Sequence[EncodedPrompt]):
    """Run the vision tower once over all images and videos of the prompts (one call, so that every process
    of an FSDP launch runs the tower's collectives once per forward, whatever its prompts hold). Returns (the
    model's vision outputs by modality, ``{"image": .., "video": ..}`` with the modalities present, or None
    when no prompt has either; the batch's ``VisionGrids``)."""
    vision, grids, _ = _encode_vision(policy, prompts, ())
    return vision, grids


def _encode_vision(policy: Policy, prompts: Sequence[EncodedPrompt], turns: Sequence[ToolTurn]):
    """``_encode_images`` of the prompts, with the images of tool ``turns`` in the same call of the tower (one call
    per forward, whatever the rows hold). Returns (the prompts' vision, their grids, the turns' image outputs in
    order or None when they have none)."""
    device = policy.device
    grids = VisionGrids.of(prompts).to(device)
    turn_grid = torch.cat([_no_grid(), *(t.image_grid_thw for t in turns)]).to(device)
    num_turn_images = turn_grid.shape[0]
    if grids.count + num_turn_images == 0:
        return None, grids, None
    pixels = [p.pixel_values for p in prompts if p.image_grid_thw.shape[0]]
    pixels += [t.pixel_values for t in turns if t.num_images]
    pixels += [p.pixel_values_videos for p in prompts if p.video_grid_thw.shape[0]]
    output = policy.model.model.get_image_features(
        torch.cat(pixels).to(device), torch.cat([grids.image, turn_grid, grids.video]), return_dict=True
    )
    num_images = grids.image.shape[0]
    vision = {}
    if num_images:
        vision["image"] = _vision_items(output, range(num_images))
    if grids.video.shape[0]:
        vision["video"] = _vision_items(output, range(num_images + num_turn_images, grids.count + num_turn_images))
    turn_vision = _vision_items(output, range(num_images, num_images + num_turn_images)) if num_turn_images else None
    return vision or None, grids, turn_vision


def _vision_items(vision_output, order) -> object:
    """The vision output of items ``order`` (indices into its per-item outputs, repeats allowed)."""
    order = list(order)
    pooled = vision_output.pooler_output
    selected = type(vision_output)(**{k: v for k, v in vision_output.items()})
    selected.pooler_output = tuple(pooled[i] for i in order)
    deepstack = getattr(vision_output, "deepstack_features", None)
    if deepstack:  # Qwen3-VL: one entry per level, each split per item like pooler_output
        counts = [t.shape[0] for t in pooled]
        per_item = [torch.split(lv, counts) if isinstance(lv, torch.Tensor) else lv for lv in deepstack]
        selected.deepstack_features = [tuple(level[i] for i in order) for level in per_item]
    return selected


def _joined_items(first, second):
    """One vision output holding ``first``'s items then ``second``'s (either may be None), for ``_vision_items``."""
    if first is None:
        return second
    joined = type(first)(**{k: v for k, v in first.items()})
    joined.pooler_output = tuple(first.pooler_output) + tuple(second.pooler_output)
    deepstack = getattr(first, "deepstack_features", None)
    if deepstack:  # Qwen3-VL: per level, the items' features concatenated in item order
        joined.deepstack_features = [
            tuple(a) + tuple(b) if isinstance(a, (tuple, list)) else torch.cat([a, b])
            for a, b in zip(deepstack, second.deepstack_features, strict=True)
        ]
    return joined


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


def _vision_inputs(vision) -> dict:
    """The model's image and video arguments for features already computed (nothing for a text-only batch)."""
    return {} if vision is None else {"mm_encoder_outputs": dict(vision)}


def _select_vision_rows(vision, prompts: Sequence[EncodedPrompt], row_prompt: list[int]):
    """Repeat the per-image and per-video features so that row r gets those of ``prompts[row_prompt[r]]``
    (``vision`` holds the prompts' items in order, as ``_encode_images`` made it)."""
    if vision is None:
        return None
    selected = {}
    for modality, count_of in (("image", lambda p: p.image_grid_thw.shape[0]), ("video", lambda p: p.video_grid_thw.shape[0])):
        if modality not in vision:
            continue
        counts = [count_of(p) for p in prompts]
        first = [sum(counts[:i]) for i in range(len(counts))]
        selected[modality] = _vision_items(vision[modality], [first[p] + j for p in row_prompt for j in range(counts[p])])
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
