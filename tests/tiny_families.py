"""Tiny randomly initialised models of the Qwen-VL families besides the embedded Qwen2.5-VL, built from configs
(real classes, real processors, the project's tokenizer): Qwen2-VL, Qwen3-VL and Qwen3.5 (hybrid: 3 Gated
DeltaNet layers and 1 full-attention layer). Shared by tests/test_model_families.py and the FSDP launch."""

from pathlib import Path

from vlm_grpo_ma.model.tiny import CHAT_TEMPLATE, build_tokenizer

TEXT_HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 1, 32  # mrope_section must sum to HEAD_DIM / 2


def _token_ids(tokenizer) -> dict:
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def _text_config(tokenizer, **extra) -> dict:
    config = dict(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    config.update(extra)
    return config


def _build_qwen2_vl(tokenizer):
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    config = Qwen2VLConfig(
        text_config=_text_config(
            tokenizer, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
        ),
        vision_config=dict(
            depth=2, embed_dim=32, hidden_size=TEXT_HIDDEN, mlp_ratio=2, num_heads=2,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        ),
        tie_word_embeddings=True,
        **_token_ids(tokenizer),
    )  # fmt: skip
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    return Qwen2VLForConditionalGeneration(config), processor


def _build_qwen3_vl(tokenizer):
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    config = Qwen3VLConfig(
        text_config=_text_config(
            tokenizer,
            head_dim=HEAD_DIM,
            rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT_HIDDEN,
            patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        tie_word_embeddings=True,
        **_token_ids(tokenizer),
    )  # fmt: skip
    # Qwen3-VL's image processor is Qwen2-VL's with 16 px patches (images resized to multiples of 32)
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=64 * 64, max_pixels=128 * 128,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    return Qwen3VLForConditionalGeneration(config), processor


def _build_qwen3_5(tokenizer):
    """Qwen3.5: the package's tiny random one (``vlm_grpo_ma.model.tiny.tiny_qwen3_5``), fp32."""
    from vlm_grpo_ma.model.tiny import tiny_qwen3_5

    return tiny_qwen3_5(tokenizer)


def _build_qwen3_5_moe(tokenizer):
    """Qwen3.5's mixture of experts: the dense tiny model's layers with 4 experts (2 per token) and a shared
    expert in place of each MLP."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    dense, processor = _build_qwen3_5(tokenizer)
    text = {k: v for k, v in dense.config.text_config.to_dict().items() if k not in ("intermediate_size", "model_type", "architectures", "dtype")}
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    config = Qwen3_5MoeConfig(
        text_config=text,
        vision_config=dense.config.vision_config.to_dict(),
        tie_word_embeddings=True,
        **_token_ids(tokenizer),
    )
    return Qwen3_5MoeForConditionalGeneration(config), processor


BUILDERS = {"qwen2_vl": _build_qwen2_vl, "qwen3_vl": _build_qwen3_vl, "qwen3_5": _build_qwen3_5, "qwen3_5_moe": _build_qwen3_5_moe}


def save_tiny(family: str, path: Path, seed: int = 0) -> Path:
    """Build the tiny ``family`` model with the project's tokenizer and save it (model and processor) to ``path``."""
    import torch

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model, processor = BUILDERS[family](tokenizer)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    processor.save_pretrained(path)
    model.save_pretrained(path)
    return path
