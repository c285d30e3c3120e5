"""The published Qwen-VL architectures as numbers, their parameter counts by hand, and random-weight stand-ins.

One source of truth for architecture numbers: ``scripts/gpu_check.py`` (the 3B GPU check),
``scripts/check_real_size.py`` (every family at its published size on a CPU) and ``vlm_grpo_ma.run.memory_model`` (the
memory model) read them from here.

``ARCHITECTURES`` holds each model's ``config.json`` as published on the Hugging Face hub (text and vision
sections), written from the hub's files (nothing can be downloaded here); ``published_parameters`` is the
count the hub shows for the checkpoint (exact for Qwen2.5-VL-3B, which the project counted before; the hub's
rounded figure for the others, so those are compared to 0.5%). ``parameter_counts`` counts parameters from
the numbers alone (no model is built); the tests check it against models built on the meta device.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QWEN_VOCAB = 151936  # the 2B-4B models' padded vocabulary; Qwen2.5-VL-7B pads to 152,064


@dataclasses.dataclass(frozen=True)
class Architecture:
    family: str  # the transformers model_type: qwen2_vl, qwen2_5_vl, qwen3_vl
    text: dict  # config.json's text_config
    vision: dict  # config.json's vision_config
    hub_id: str = ""
    published_parameters: int | None = None
    published_exact: bool = False  # False: published_parameters is the hub's figure rounded to 10M


QWEN2_5_VL_3B = Architecture(
    family="qwen2_5_vl",
    hub_id="Qwen/Qwen2.5-VL-3B-Instruct",
    published_parameters=3_754_622_976,
    published_exact=True,
    text=dict(
        vocab_size=QWEN_VOCAB, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2,  # head_dim 128
        hidden_act="silu", max_position_embeddings=128000, rms_norm_eps=1e-6, use_sliding_window=False,
        sliding_window=32768, max_window_layers=70, tie_word_embeddings=True,  # 3B ties lm_head to the embedding
        # mrope_section sums to head_dim / 2 = 64: temporal, height, width
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    ),
    vision=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, hidden_act="silu",
        in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        window_size=112,  # window attention over 112 px = 8x8 patches = 4x4 merged tokens
        fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
    ),
)  # fmt: skip

QWEN2_5_VL_7B = Architecture(
    family="qwen2_5_vl",
    hub_id="Qwen/Qwen2.5-VL-7B-Instruct",
    published_parameters=8_290_000_000,
    text=dict(
        QWEN2_5_VL_3B.text, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_window_layers=28, tie_word_embeddings=False,
    ),
    vision=dict(QWEN2_5_VL_3B.vision, out_hidden_size=3584),
)  # fmt: skip

QWEN2_VL_2B = Architecture(
    family="qwen2_vl",
    hub_id="Qwen/Qwen2-VL-2B-Instruct",
    published_parameters=2_210_000_000,
    text=dict(
        vocab_size=QWEN_VOCAB, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2,  # head_dim 128
        hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False,
        sliding_window=32768, max_window_layers=28, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    ),
    # Qwen2-VL's tower: LayerNorms, a plain (not gated) quick-GELU MLP of mlp_ratio x embed_dim, full attention
    # in every block (no windows); hidden_size is the merger's output (the text width)
    vision=dict(
        depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, hidden_act="quick_gelu",
        in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    ),
)  # fmt: skip

QWEN3_VL_4B = Architecture(
    family="qwen3_vl",
    hub_id="Qwen/Qwen3-VL-4B-Instruct",
    published_parameters=4_440_000_000,
    text=dict(
        vocab_size=QWEN_VOCAB, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu", attention_bias=False,
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        # interleaved mRoPE: sections sum to head_dim / 2 = 64
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    ),
    # Qwen3-VL's tower: 16 px patches, learned position embeddings (interpolated), LayerNorms, plain GELU MLP,
    # full attention everywhere; features of blocks 5, 11, 17 are merged and added to the first text layers
    vision=dict(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
        hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
        num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
    ),
)  # fmt: skip

QWEN3_VL_2B = Architecture(
    family="qwen3_vl",
    hub_id="Qwen/Qwen3-VL-2B-Instruct",
    published_parameters=2_130_000_000,
    text=dict(
        QWEN3_VL_4B.text, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8,
    ),
    vision=dict(QWEN3_VL_4B.vision, out_hidden_size=2048),
)  # fmt: skip

ARCHITECTURES = {
    "qwen2-vl-2b": QWEN2_VL_2B,
    "qwen2.5-vl-3b": QWEN2_5_VL_3B,
    "qwen2.5-vl-7b": QWEN2_5_VL_7B,
    "qwen3-vl-2b": QWEN3_VL_2B,
    "qwen3-vl-4b": QWEN3_VL_4B,
}


def shrunk(arch: Architecture) -> Architecture:
    """The same family and structure (vocabulary, window/full-attention blocks, deepstack, tied embeddings)
    with every width and depth cut down, so that a script's whole path runs on a CPU in seconds."""
    text = dict(arch.text, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    if arch.family == "qwen3_vl":
        text.update(head_dim=32, num_key_value_heads=1)
        rope = dict(arch.text["rope_parameters"], mrope_section=[6, 5, 5])
        vision = dict(arch.vision, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1])  # fmt: skip
    elif arch.family == "qwen2_vl":
        rope = dict(arch.text["rope_parameters"], mrope_section=[4, 6, 6])  # head_dim 32
        vision = dict(arch.vision, depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2)
    else:
        rope = dict(arch.text["rope_parameters"], mrope_section=[4, 6, 6])
        vision = dict(arch.vision, depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
                      fullatt_block_indexes=[1])  # fmt: skip
    text["rope_parameters"] = rope
    return dataclasses.replace(arch, text=text, vision=vision, published_parameters=None, hub_id=arch.hub_id + " (shrunk)")


def architecture_of(name_or_path: str) -> Architecture:
    """The architecture of a hub id (``ARCHITECTURES``), an ``ARCHITECTURES`` key, or a local model folder
    (its ``config.json``; ``tiny`` is the embedded model)."""
    for key, arch in ARCHITECTURES.items():
        if name_or_path in (key, arch.hub_id):
            return arch
    if name_or_path == "tiny":
        from vlm_grpo_ma.model.tiny import TINY_MODEL_DIR

        name_or_path = str(TINY_MODEL_DIR)
    config_file = Path(name_or_path) / "config.json"
    if not config_file.is_file():
        known = ", ".join([a.hub_id for a in ARCHITECTURES.values()] + list(ARCHITECTURES) + ["tiny"])
        raise ValueError(f"unknown model {name_or_path!r}: not a local folder with a config.json nor one of {known}")
    return from_config_json(json.loads(config_file.read_text()))


def from_config_json(config: dict) -> Architecture:
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not one of {', '.join(FAMILIES)}")
    text = dict(config.get("text_config") or {k: v for k, v in config.items() if k != "vision_config"})
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return Architecture(family=family, text=text, vision=dict(config["vision_config"]))


# ----------------------------------------------------------------------------------------------------------
# Counting by hand


def head_dim(text: dict) -> int:
    return text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]


def _linear(n_in: int, n_out: int, bias: bool) -> tuple[int, int]:
    """(elements, tensors) of a Linear layer."""
    return n_in * n_out + (n_out if bias else 0), 2 if bias else 1


def _sum(*parts: tuple[int, int]) -> tuple[int, int]:
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def _times(n: int, part: tuple[int, int]) -> tuple[int, int]:
    return n * part[0], n * part[1]


def text_layer_linears(arch: Architecture) -> dict[str, tuple[int, int, bool]]:
    """Each decoder layer's projections: name -> (in_features, out_features, has bias). Qwen2 puts biases on
    q/k/v; Qwen3 has none."""
    t = arch.text
    h, q, kv = t["hidden_size"], t["num_attention_heads"] * head_dim(t), t["num_key_value_heads"] * head_dim(t)
    qkv_bias = arch.family != "qwen3_vl"
    return {
        "q_proj": (h, q, qkv_bias), "k_proj": (h, kv, qkv_bias), "v_proj": (h, kv, qkv_bias), "o_proj": (q, h, False),
        "gate_proj": (h, t["intermediate_size"], False), "up_proj": (h, t["intermediate_size"], False),
        "down_proj": (t["intermediate_size"], h, False),
    }  # fmt: skip


def _text_counts(arch: Architecture) -> tuple[int, int]:
    t = arch.text
    h = t["hidden_size"]
    layer = _sum(*(_linear(i, o, b) for i, o, b in text_layer_linears(arch).values()), (2 * h, 2))  # + 2 RMSNorms
    if arch.family == "qwen3_vl":
        layer = _sum(layer, (2 * head_dim(t), 2))  # q_norm, k_norm
    embedding = (t["vocab_size"] * h, 1)
    lm_head = (0, 0) if t.get("tie_word_embeddings") else embedding
    return _sum(embedding, _times(t["num_hidden_layers"], layer), (h, 1), lm_head)


def _vision_counts(arch: Architecture) -> tuple[int, int]:
    v = arch.vision
    norm_tensors = 1 if arch.family == "qwen2_5_vl" else 2  # RMSNorm (weight) or LayerNorm (weight, bias)
    if arch.family == "qwen2_vl":
        width, inner, out = v["embed_dim"], v["embed_dim"] * v["mlp_ratio"], v["hidden_size"]
        mlp = _sum(_linear(width, inner, True), _linear(inner, width, True))
    elif arch.family == "qwen2_5_vl":
        width, inner, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
        mlp = _sum(_linear(width, inner, True), _linear(width, inner, True), _linear(inner, width, True))  # gated
    else:
        width, inner, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
        mlp = _sum(_linear(width, inner, True), _linear(inner, width, True))
    norm = (norm_tensors * width, norm_tensors)
    block = _sum(norm, norm, _linear(width, 3 * width, True), _linear(width, width, True), mlp)
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * width
    patch_embed = (patch + width, 2) if arch.family == "qwen3_vl" else (patch, 1)  # Qwen3-VL's conv has a bias
    merged = width * v["spatial_merge_size"] ** 2

    def merger(norm_width: int) -> tuple[int, int]:
        return _sum((norm_tensors * norm_width, norm_tensors), _linear(merged, merged, True), _linear(merged, out, True))

    parts = [patch_embed, _times(v["depth"], block), merger(width)]
    if arch.family == "qwen3_vl":
        parts.append((v["num_position_embeddings"] * width, 1))  # learned position embeddings
        parts.append(_times(len(v["deepstack_visual_indexes"]), merger(merged)))  # norm after the 2x2 merge
    return _sum(*parts)


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    text: int  # language model: embedding, decoder layers, final norm, lm_head (when not tied)
    vision: int  # vision tower and its merger(s)
    text_tensors: int
    vision_tensors: int

    @property
    def total(self) -> int:
        return self.text + self.vision


def parameter_counts(arch: Architecture) -> ParameterCounts:
    (text, text_tensors), (vision, vision_tensors) = _text_counts(arch), _vision_counts(arch)
    return ParameterCounts(text=text, vision=vision, text_tensors=text_tensors, vision_tensors=vision_tensors)


def lora_counts(arch: Architecture, rank: int, target_modules: list[str]) -> tuple[int, int]:
    """(elements, tensors) of LoRA adapters of ``rank`` on the decoder layers' projections named in
    ``target_modules`` (A: rank x in, B: out x rank, per projection and layer); the vision tower gets none."""
    linears = text_layer_linears(arch)
    unknown = [m for m in target_modules if m not in linears]
    if unknown:
        raise ValueError(f"LoRA target modules {unknown} are not decoder projections; valid: {', '.join(linears)}")
    per_layer = sum(rank * (linears[m][0] + linears[m][1]) for m in target_modules)
    layers = arch.text["num_hidden_layers"]
    return layers * per_layer, layers * 2 * len(target_modules)


# ----------------------------------------------------------------------------------------------------------
# Random-weight stand-ins


def build_config(arch: Architecture, tokenizer):
    """A transformers config of ``arch`` whose special-token ids are ``tokenizer``'s (the real vocabulary's
    size is kept: every id of the tokenizer must fit in it)."""
    import transformers

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in [
        ("pad", "<|endoftext|>"), ("eos", "<|im_end|>"), ("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
        ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"),
    ]}  # fmt: skip
    vocab = arch.text["vocab_size"]
    if max(ids.values()) >= vocab or len(tokenizer) > vocab:
        raise ValueError(f"tokenizer of {len(tokenizer)} tokens does not fit vocab_size {vocab}")
    config_class = {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig", "qwen3_vl": "Qwen3VLConfig"}[arch.family]
    text = dict(arch.text, bos_token_id=ids["pad"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], attention_dropout=0.0)
    extra = {} if arch.family == "qwen3_vl" else dict(bos_token_id=ids["pad"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    return getattr(transformers, config_class)(
        text_config=text,
        vision_config=dict(arch.vision),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=arch.text["tie_word_embeddings"],
        **extra,
    )


def build_model(config, *, device: str = "cpu", dtype: str = "float32", seed: int = 0):
    """Random weights of ``config``'s model class, allocated directly on ``device`` in ``dtype`` (no fp32
    copy of a multi-billion-parameter model on the way)."""
    import torch
    import transformers

    model_class = {
        "qwen2_vl": "Qwen2VLForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
    }[config.model_type]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    return model


def build_processor(arch: Architecture, tokenizer, *, min_pixels: int, max_pixels: int):
    """The family's real processor around ``tokenizer`` (the project's tiny tokenizer stands in for Qwen's:
    its ids all fit in the real vocabulary), resizing images to between ``min_pixels`` and ``max_pixels``."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    from vlm_grpo_ma.model.tiny import CHAT_TEMPLATE

    patch, merge = arch.vision["patch_size"], arch.vision["spatial_merge_size"]
    extra = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]) if arch.family == "qwen3_vl" else {}
    images = Qwen2VLImageProcessor(patch_size=patch, merge_size=merge, temporal_patch_size=arch.vision["temporal_patch_size"],
                                   min_pixels=min_pixels, max_pixels=max_pixels, **extra)  # fmt: skip
    names = {
        "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
        "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
        "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    }[arch.family]
    return getattr(transformers, names[0])(
        image_processor=images, tokenizer=tokenizer, video_processor=getattr(transformers, names[1])(), chat_template=CHAT_TEMPLATE
    )


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
