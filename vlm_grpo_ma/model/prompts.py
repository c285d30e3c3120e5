"""Prompts and images: one sample through the chat template and the processor (``EncodedPrompt``), and the
model inputs that sampling and scoring share: mRoPE positions of a padded batch, the vision tower run once
per image, and padding."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.task_api.coords import Size
from vlm_grpo_ma.task_api.images import ImageLoadError, decode_image
from vlm_grpo_ma.task_api.registry import Sample


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


# What a thinking model's chat template (Qwen3.5, Qwen3-VL-Thinking) appends to the generation prompt to open
# the thought for the model.
OPENED_THOUGHT = "<think>"


def generation_prompt(policy: Policy, sample: Sample, instruction: str) -> str:
    """The chat template's text for one sample, ending where the model starts to write. A template that opens
    the thought itself (``<|im_start|>assistant\\n<think>\\n``) has that tag taken back: the tasks ask for the
    whole ``<think>...</think><answer>...</answer>`` and score its format, so on every family the completion,
    tags included, is the model's."""
    text = policy.processor.apply_chat_template(
        prompt_messages(sample, instruction), add_generation_prompt=True, tokenize=False
    )
    stripped = text.rstrip()
    if stripped.endswith(OPENED_THOUGHT):
        text = stripped[: -len(OPENED_THOUGHT)]
    return text


def encode_prompt(policy: Policy, sample: Sample, instruction: str) -> EncodedPrompt:
    """Chat template + processor for one sample. Raises ImageLoadError for a broken or missing image, and for
    one the processor refuses."""
    images = [open_image(image) for image in sample.images]
    text = generation_prompt(policy, sample, instruction)
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
