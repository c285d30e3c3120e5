"""Memory model: the bytes one GPU holds for a run, predicted from architecture numbers and the config.

Read by ``python -m vlm_grpo_ma.memory`` (``tools/memory.py``: a preset's table) and by the run's start
(``check_fits``: a K x M that cannot fit is refused before the model loads).

Every figure is a pure function of (``architectures.Architecture``, ``config.Config``, processes, strategy):

- weights: every parameter in ``model.dtype``, LoRA adapters in fp32 (peft keeps them so); FSDP: 1/N each.
- gradients: one per trained element, in the trained parameters' dtype. FSDP: 1/N, except that with more than
  one micro-batch per process a unit keeps its unsharded gradient through the step (``sharding.sync_gradients``).
- optimizer: AdamW's two moments per trained element in its dtype plus one 4-byte step count per trained
  tensor; SGD none. FSDP: the moments 1/N (every process keeps its step counts).
- KL reference (``algorithm.kl_coef > 0``): a frozen copy of the weights (FSDP: 1/N); none with LoRA, whose
  reference is the same model with the adapters off.
- activations (the update's peak): one micro-batch of ``train.micro_batch_rows`` rows. What a decoder layer
  keeps for backward per token it encodes (``layer_bytes_per_token``) is the inventory autograd saves, measured
  with saved-tensor hooks (tests/test_memory.py): both RMSNorms' inputs in fp32, the projections' inputs, the
  MLP's four intermediate-width tensors, the new keys and values, LoRA's input casts and rank-wide outputs,
  Qwen3-VL's q/k norm inputs. Attention also keeps, per layer and row of a block, the keys and values of the
  row's whole context repeated to every query head (sdpa's grouped-query path; ``attention_bytes``).
  Qwen3.5's hybrid layers are counted by kind (``architectures.layer_types``): its full-attention layers keep
  the same and their gate and q/k norms; its Gated DeltaNet layers keep no context but, in transformers'
  torch chunked delta rule (``linear_attention_row_bytes``), fp32 copies of every row's tokens padded to chunks of
  64 and, per chunk, the recurrent state (measured with saved-tensor hooks in tests/test_memory.py). With
  LoRA under bf16 autocast the adapters' bf16 casts are kept too. Gradient checkpointing (rows re-encode
  prompt + thought + answer: transformers drops the KV cache) keeps every layer's input and one layer's
  tensors at a time; Qwen3.5-MoE's layers (``moe_bytes_per_token``, approximate) keep per token the tensors of the
  ``num_experts_per_tok`` routed experts it runs through and the shared expert's, while its weights, gradients and
  optimizer state count every expert (``parameter_counts``); without it the rows are tree-shared (each prompt and thought of the micro-batch encoded
  once, ``logprobs.shared_prefix_logprobs``) and every layer's tensors of those tokens are kept. The log-prob
  head: the scored positions' logits in the compute dtype, their fp32 copy, log-softmax and its gradient
  (3 x 4 bytes). A trained vision tower adds its checkpointed block inputs for the micro-batch's images and
  videos.
- KV cache (the rollout's peak): keys and values of every layer for the process's prompts x (K x M + K) rows
  (the K thought rows and their K x M copies exist together while the cache is repeated), each of prompt +
  thought + answer tokens, values in the compute dtype and keys in the weights' (the rotary embedding promotes
  them: fp32 keys under bf16 autocast on fp32 weights); plus the sampled rows' fp32 logits, probabilities and
  log-probabilities over the vocabulary. A hybrid model (Qwen3.5) keeps keys and values in its full-attention
  layers only; each Gated DeltaNet layer holds per row a conv state and an fp32 recurrent state of fixed size
  instead (``recurrent_state_bytes``; ``MemoryEstimate.recurrent_states``), whatever the row's length. FSDP
  gathers the whole model for the rollout: the other (N-1)/N of the weights are added to this phase.

- vLLM engine (``rollout.engine=vllm``): the engine takes ``rollout.vllm_gpu_memory_utilization`` of the GPU
  (its weights, ``parameters x engine dtype / rollout.vllm_tensor_parallel_size``, and its KV cache in that
  share), and the trainer then holds no KV cache and gathers nothing for the rollout. With
  ``rollout.vllm_sleep`` the engine frees it all (sleep level 2) for the update, so only the rollout phase
  counts it. Pushing the weights adds one tensor at a time: at most the largest tensor (the embedding) as an
  fp32 copy (FSDP's gather, LoRA's merge) and its cast to the engine's dtype.

A split launch (``rollout.engine_processes``, ``run/split_launch.py``) is counted per role (``estimate``'s
``role``): a trainer process samples nothing (no KV cache, no FSDP gather, no vLLM engine); an engine process
holds the whole model once in ``model.dtype`` (the trainers send merged weights: no adapters; not sharded) and
its share's KV cache (prompts_per_step / engine processes), or its vLLM engine alone (the copy that receives the
weights then stays in host memory), and trains nothing.

The peak is weights + optimizer + reference + the larger of (rollout: KV cache [+ FSDP gather] or the engine's
share and one pushed tensor) and (update: gradients + activations [+ the engine's share unless it sleeps]). A prompt is its visual tokens (``model.max_pixels`` / (patch x merge)^2) plus
``prompt_text_tokens`` (64: system prompt and instruction), plus, for data with videos (``videos_per_prompt``:
the most videos a sample holds), each video's tokens at the budget's limit (``video_tokens``:
``model.video_max_frames`` / temporal patch x ``model.video_max_pixels`` / (patch x merge)^2). Not counted: CUDA context and allocator slack
(~1-3 GB on a GPU), image preprocessing on the host. ``scripts/check_real_size.py`` compares the one-process
prediction with the peak RSS measured on a CPU; ``scripts/check_two_process.py --strategy fsdp`` prints the
per-rank parameter, gradient, optimizer and reference bytes the FSDP split is checked against.
"""

from __future__ import annotations

import dataclasses
import math

from vlm_grpo_ma.model.architectures import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    QWEN3_5_FAMILIES,
    Architecture,
    head_dim,
    layer_types,
    linear_attention_dims,
    lora_counts,
    parameter_counts,
    text_layer_linears,
)
from vlm_grpo_ma.run.config import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STRATEGIES = ("ddp", "fsdp")
ROLES = ("both", "trainer", "engine")  # a process that samples and trains; a split launch's trainer or engine
PARTS = ("weights", "gradients", "optimizer", "reference", "activations", "kv_cache")
PROMPT_TEXT_TOKENS = 64
GPU_SIZES_GB = (80, 141)
TIGHT = 0.95  # a peak above 95% of the GPU is called tight: CUDA context and allocator slack are not counted
DELTA_RULE_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule: each row's tokens are padded to whole chunks


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    kv_cache: int
    fsdp_rollout_gather: int  # FSDP: the rest of the weights, gathered for the rollout
    gradients_between_steps: int  # FSDP: the shards (what sharding.state_bytes reads after a step)
    trained_elements: int
    micro_batches_per_process: int
    engine: int = 0  # vLLM: its share of the GPU while awake (weights + KV cache)
    engine_in_update: int = 0  # vLLM: what it holds during the update (0 when it sleeps)
    engine_weights: int = 0  # vLLM: its weights on this GPU (within ``engine``)
    push_transient: int = 0  # vLLM: the one tensor being pushed (fp32 copy + cast)
    recurrent_states: int = 0  # of kv_cache: the Gated DeltaNet layers' conv and recurrent states (hybrid models)

    @property
    def rollout_peak(self) -> int:
        return self.weights + self.optimizer + self.reference + self.kv_cache + self.fsdp_rollout_gather + self.engine + self.push_transient

    @property
    def update_peak(self) -> int:
        return self.weights + self.optimizer + self.reference + self.gradients + self.activations + self.engine_in_update

    @property
    def peak(self) -> int:
        return max(self.rollout_peak, self.update_peak)


def compute_bytes(cfg: Config) -> int:
    """Bytes per element of activations and the KV cache: bf16 under autocast or bf16 weights, else the weights'."""
    return 2 if cfg.train.mixed_precision == "bf16" else DTYPE_BYTES[cfg.model.dtype]


def visual_tokens(arch: Architecture, max_pixels: int | None) -> int:
    """Visual tokens of the largest image the processor lets through (``max_pixels``; None: the tiny
    processor's 168 x 168)."""
    pixels = max_pixels if max_pixels is not None else 168 * 168
    merged_patch = arch.vision["patch_size"] * arch.vision["spatial_merge_size"]
    return pixels // merged_patch**2


def video_tokens(arch: Architecture, max_frames: int, max_pixels: int) -> int:
    """Decoder tokens of the longest, largest video the budget lets through (``model.video_max_frames`` frames
    of ``model.video_max_pixels`` pixels): the vision tower takes frames in groups of ``temporal_patch_size``
    (decoding samples an even count of at most ``max_frames``) and each group gives one frame's visual tokens."""
    return max_frames // arch.vision["temporal_patch_size"] * visual_tokens(arch, max_pixels)


def trained_counts(arch: Architecture, cfg: Config) -> tuple[int, int, int]:
    """(trained elements, trained tensors, bytes per trained element)."""
    if cfg.model.lora_rank > 0:
        elements, tensors = lora_counts(arch, cfg.model.lora_rank, cfg.model.lora_target_modules)
        return elements, tensors, 4
    counts = parameter_counts(arch)
    if cfg.model.freeze_vision:
        return counts.text, counts.text_tensors, DTYPE_BYTES[cfg.model.dtype]
    return counts.total, counts.text_tensors + counts.vision_tensors, DTYPE_BYTES[cfg.model.dtype]


def layer_bytes_per_token(arch: Architecture, cfg: Config, layer_type: str = FULL_ATTENTION) -> int:
    """Bytes one decoder layer keeps for backward per token it encodes, besides attention's keys and values over
    the context (``attention_bytes``) or a Gated DeltaNet's padded chunks (``linear_attention_row_bytes``). Counted
    from what autograd saves (tests/test_memory.py measures it): the two RMSNorms' inputs in fp32 (2 x hidden x
    4), the MLP's gate, up, activation and product (4 x intermediate), the new keys and values (2 x kv), the
    attention and MLP projections' inputs (4 x hidden; with LoRA on them 6 x hidden, and each adapter's
    rank-wide output), and Qwen3-VL's q/k norms' fp32 inputs (and, when those norms are trained, their
    outputs). Qwen3.5 and Qwen3.5-MoE: ``_qwen3_5_bytes_per_token``."""
    if arch.family in QWEN3_5_FAMILIES:
        return _qwen3_5_bytes_per_token(arch, cfg, layer_type)
    a = compute_bytes(cfg)
    t = arch.text
    h, intermediate = t["hidden_size"], t["intermediate_size"]
    q, kv = t["num_attention_heads"] * head_dim(t), t["num_key_value_heads"] * head_dim(t)
    lora = cfg.model.lora_rank > 0
    kept = 2 * h * 4 + 4 * intermediate * a + 2 * kv * a
    kept += (6 * h + len(cfg.model.lora_target_modules) * cfg.model.lora_rank) * a if lora else 4 * h * a
    if arch.family == "qwen3_vl":
        kept += (q + kv) * 4 + (0 if lora else (q + kv) * a)
    return kept


def _qwen3_5_bytes_per_token(arch: Architecture, cfg: Config, layer_type: str) -> int:
    """Qwen3.5's inventory per token (measured with saved-tensor hooks, tests/test_memory.py). Its RMSNorms are
    zero-centred (x * (1 + weight)) and keep their fp32 input and, when their weight trains, the fp32 normalised
    output too. Both kinds keep the two norms' (and their fp32 rsqrt), the mixer's and the MLP's inputs and the
    MLP's four intermediate tensors. A full-attention layer adds its q/k norms (fp32, as above), the rotary cos
    and sin (head_dim x partial_rotary_factor each), the queries, the new keys and values, sdpa's output and
    log-sum-exp, and for the output gate the attention output, the sigmoid and o_proj's input. A Gated DeltaNet
    layer adds the causal conv's input and output (conv channels), the update rate beta and the decay's
    softplus (per value head), the l2-normalised queries and keys in fp32 (repeated to every value head), the
    gated RMSNorm (3 fp32 and 2 compute-dtype copies of the value width) and out_proj's input. LoRA (not measured on Qwen3.5): as ``layer_bytes_per_token``, 2 x
    hidden of input casts and the rank-wide outputs of the layer's adapted projections. Qwen3.5-MoE: the MoE block
    (``moe_bytes_per_token``) in place of the MLP's four intermediate tensors."""
    a, t = compute_bytes(cfg), arch.text
    h = t["hidden_size"]
    rank = cfg.model.lora_rank
    norm_copies = 1 if rank else 2  # fp32 input, and the normalised output when the norm's weight trains
    mlp = moe_bytes_per_token(arch, cfg) if arch.family == "qwen3_5_moe" else 4 * t["intermediate_size"] * a
    kept = 2 * (norm_copies * h + 1) * 4 + 2 * h * a + mlp
    if rank:
        adapted = [m for m in cfg.model.lora_target_modules if m in text_layer_linears(arch, layer_type)]
        kept += (2 * h + len(adapted) * rank) * a
    if layer_type == LINEAR_ATTENTION:
        _, value, conv = linear_attention_dims(t)
        heads = t["linear_num_value_heads"]
        return (
            kept + 2 * conv * a + heads * (a + 2 * 4) + 2 * heads * (t["linear_key_head_dim"] + 1) * 4
            + value * (3 * 4 + 2 * a) + heads * 4 + value * a
        )  # fmt: skip
    heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    q, kv = heads * head_dim(t), kv_heads * head_dim(t)
    rotary = int(head_dim(t) * t["rope_parameters"].get("partial_rotary_factor", 1.0))
    qk_norms = (norm_copies * (q + kv) + heads + kv_heads) * 4
    return kept + qk_norms + 2 * rotary * a + (q + 2 * kv + q) * a + heads * 4 + 3 * q * a


def moe_bytes_per_token(arch: Architecture, cfg: Config) -> int:
    """Bytes a Qwen3.5-MoE block keeps for backward per token besides its input (counted with the layer's), in
    transformers' eager expert loop (``Qwen3_5MoeExperts``): each token runs through ``num_experts_per_tok``
    routed experts, whatever the routing, and each of those keeps the dense MLP's four intermediate tensors
    (gate, up, activation, product: 4 x moe_intermediate), its gathered input and its output before the routing
    weight (2 x hidden) and two int64 indices; the shared expert keeps its four (4 x shared_expert_intermediate)
    and its output before the sigmoid gate (hidden); the router keeps its fp32 probabilities over every expert.
    Approximate: the routing weights, the gate's sigmoid and the top-k's indices are left out (a few bytes per
    token; the formula lands within 2% of what autograd saves, tests/test_memory.py), and grouped-GEMM kernels
    (``experts_implementation``) keep other tensors. The experts of one token are counted, not all of them."""
    a, t = compute_bytes(cfg), arch.text
    h, k = t["hidden_size"], t["num_experts_per_tok"]
    routed = k * ((4 * t["moe_intermediate_size"] + 2 * h) * a + 2 * 8)
    return routed + (4 * t["shared_expert_intermediate_size"] + h) * a + t["num_experts"] * 4


def linear_attention_row_bytes(arch: Architecture, cfg: Config, rows: int, tokens: int, *, from_state: bool = False, keeps_state: bool = False) -> int:
    """Bytes one Gated DeltaNet layer keeps for ``rows`` rows of ``tokens`` new tokens each beyond its per-token
    tensors (``layer_bytes_per_token``), in transformers' torch chunked delta rule (``torch_chunk_gated_delta_rule``,
    what runs without the flash-linear-attention kernels; those recompute inside the chunks, so this is an upper
    bound there). Each row's tokens are padded to whole chunks of 64 (an answer of 3 tokens costs a chunk), and
    per padded token and value head it keeps fp32 copies of beta, the values, keys (4) and the cumulative decay
    (3), the chunk's two pairwise matrices in fp32 and their compute-dtype products, and the compute-dtype casts of
    the keys and queries the intra-chunk matmuls take; per chunk and value head, the recurrent state (fp32 and
    two casts, dk x dv) and the chunk's matmul operands: less in the first chunk of a row that starts from a zero
    state (not ``from_state``: nothing flows back into it) and in the last chunk of a row whose final state is
    dropped (not ``keeps_state``: that update is freed with it). The causal conv also keeps its K - 1 tokens of
    left context per row. Measured with saved-tensor hooks (tests/test_memory.py)."""
    a, t = compute_bytes(cfg), arch.text
    heads, dk, dv = t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]
    chunk = DELTA_RULE_CHUNK
    chunks = math.ceil(tokens / chunk)
    per_padded_token = 4 * 4 + 2 * dv * 4 + 4 * dk * 4 + 2 * chunk * 4 + (4 * dk + 2 * chunk) * a
    per_chunk = dk * dv * (2 * a + 4) + chunk * (3 * dk + 2 * dv) * a + chunk * chunk * a
    first_chunk = 0 if from_state else 2 * chunk * dk * a  # the chunk keys' and queries' casts for the state's gradient
    last_chunk = 0 if keeps_state else dk * dv * 4 + chunk * (dk + dv) * a  # the state update nothing reads
    _, _, conv = linear_attention_dims(t)
    delta_rule = chunks * chunk * per_padded_token + chunks * per_chunk - first_chunk - last_chunk
    return rows * (heads * delta_rule + (t["linear_conv_kernel_dim"] - 1) * conv * a)


def attention_bytes(arch: Architecture, cfg: Config, rows: int, context: int) -> int:
    """Bytes one decoder layer's attention keeps for ``rows`` rows that attend to ``context`` tokens each: their
    keys and values repeated to every query head (transformers' sdpa path copies them for grouped-query
    attention; flash-attention keeps them unrepeated, so this is an upper bound there)."""
    t = arch.text
    return 2 * rows * context * t["num_attention_heads"] * head_dim(t) * compute_bytes(cfg)


def layer_bytes(
    arch: Architecture, cfg: Config, layer_type: str, rows: int, tokens: int, context: int, *, keeps_state: bool = False
) -> int:  # fmt: skip
    """Bytes one decoder layer of ``layer_type`` keeps for ``rows`` rows that each encode ``tokens`` new tokens
    attending to ``context`` tokens (the new ones included; more: the rows continue a cached prefix): per token,
    and the mixer's own (attention: the context's keys and values; Gated DeltaNet: the padded chunks, which do
    not grow with the context, starting from the prefix's state and, with ``keeps_state``, leaving theirs to
    rows that continue them)."""
    if layer_type == LINEAR_ATTENTION:
        mixer = linear_attention_row_bytes(arch, cfg, rows, tokens, from_state=context > tokens, keeps_state=keeps_state)
    else:
        mixer = attention_bytes(arch, cfg, rows, context)
    return rows * tokens * layer_bytes_per_token(arch, cfg, layer_type) + mixer


def tree_shared_layer_bytes(
    arch: Architecture, cfg: Config, *, prompts: int, prompt_tokens: int, thoughts: int, thought_tokens: int, rows: int, answer_tokens: int,
    layer_type: str = FULL_ATTENTION,
) -> int:  # fmt: skip
    """Bytes one decoder layer keeps in the tree-shared training forward (``logprobs.shared_prefix_logprobs``):
    ``prompts`` prompts encoded once, ``thoughts`` thoughts once each on their prompt's cache, ``rows`` answers on
    their thought's (an answer's last token is not fed: it predicts nothing scored). A Gated DeltaNet layer
    keeps the final state of prompts and thoughts (their rows continue from it), not of answers: the cache that
    holds it is dropped before backward."""
    answer_fed = max(answer_tokens - 1, 1)
    return (
        layer_bytes(arch, cfg, layer_type, prompts, prompt_tokens, prompt_tokens, keeps_state=True)
        + layer_bytes(arch, cfg, layer_type, thoughts, thought_tokens, prompt_tokens + thought_tokens, keeps_state=True)
        + layer_bytes(arch, cfg, layer_type, rows, answer_fed, prompt_tokens + thought_tokens + answer_fed)
    )


def recurrent_state_bytes(arch: Architecture, cfg: Config) -> int:
    """Bytes one Gated DeltaNet layer's decode cache holds per row, whatever the row's length: the causal conv's
    state (its last ``linear_conv_kernel_dim`` inputs over the conv channels, in the compute dtype: in_proj_qkv's
    output) and the delta rule's recurrent state (value heads x key head dim x value head dim, fp32: transformers'
    torch path computes the rule in fp32 and caches its final state as it is)."""
    t = arch.text
    _, _, conv = linear_attention_dims(t)
    conv_state = conv * t["linear_conv_kernel_dim"] * compute_bytes(cfg)
    return conv_state + t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"] * 4


def decode_cache_bytes(arch: Architecture, cfg: Config, rows: int, tokens: int) -> tuple[int, int]:
    """(keys and values, recurrent states) of the decode cache of ``rows`` rows of ``tokens`` tokens: keys and
    values in the full-attention layers only, growing with ``tokens``; a fixed-size state per row in each Gated
    DeltaNet layer (``recurrent_state_bytes``)."""
    kinds = layer_types(arch.text)
    kv = arch.text["num_key_value_heads"] * head_dim(arch.text)
    # keys leave the rotary embedding in the weights' dtype (its cos and sin come in the embeddings' dtype and
    # k x cos promotes to it), values in the compute dtype: under bf16 autocast on fp32 weights the cache holds
    # fp32 keys and bf16 values (measured on every family, transformers 5.25; tests/test_memory.py)
    key_bytes, value_bytes = DTYPE_BYTES[cfg.model.dtype], compute_bytes(cfg)
    keys_values = rows * tokens * kinds.count(FULL_ATTENTION) * kv * (key_bytes + value_bytes)
    linear = kinds.count(LINEAR_ATTENTION)
    return keys_values, (rows * linear * recurrent_state_bytes(arch, cfg) if linear else 0)


def estimate(
    arch: Architecture, cfg: Config, processes: int = 1, strategy: str = "ddp", prompt_text_tokens: int = PROMPT_TEXT_TOKENS,
    device_bytes: int | None = None, videos_per_prompt: int = 0, tool_images_per_thought: int = 0, role: str = "both",
) -> MemoryEstimate:  # fmt: skip
    """The bytes per GPU of ``cfg`` on ``processes`` GPUs under ``strategy``. ``role``: "both" (a process that
    samples and trains), or a split launch's "trainer" (``processes``: the trainer processes) or "engine"
    (``processes``: the engine processes, each sampling prompts_per_step / processes prompts; ``strategy`` does
    not apply: an engine holds the whole model). ``device_bytes``: one GPU's memory,
    needed where the vLLM engine samples (it takes a share of it). ``videos_per_prompt``: the most videos a
    sample of the run's data holds (0: data without videos adds nothing). ``tool_images_per_thought``: the crops a
    thought may get back (``rollout.max_turns`` for a task with tools): their tokens lie inside the thought's
    budget, so only a trained vision tower's activations for them are added."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if videos_per_prompt < 0:
        raise ValueError(f"videos_per_prompt {videos_per_prompt}: must be >= 0")
    if processes < 1 or cfg.train.prompts_per_step % processes:
        raise ValueError(f"processes {processes}: must be >= 1 and divide train.prompts_per_step ({cfg.train.prompts_per_step})")
    shard = processes if strategy == "fsdp" and role != "engine" else 1
    counts = parameter_counts(arch)
    weight_bytes = DTYPE_BYTES[cfg.model.dtype]
    trained, trained_tensors, trained_bytes = trained_counts(arch, cfg)
    lora_bytes = trained * trained_bytes if cfg.model.lora_rank > 0 else 0
    full_weights = counts.total * weight_bytes + lora_bytes
    weights = math.ceil(full_weights / shard)

    prompts = cfg.train.prompts_per_step // processes
    k, m = cfg.rollout.num_thoughts, cfg.rollout.num_answers
    rows = prompts * k * m  # answer rows = training rows of the process
    micro_batches = math.ceil(rows / cfg.train.micro_batch_rows)
    unsharded_grads = strategy == "fsdp" and micro_batches > 1
    gradients = trained * trained_bytes if unsharded_grads else math.ceil(trained * trained_bytes / shard)
    optimizer = 0
    if cfg.train.optimizer == "adamw":
        optimizer = math.ceil(2 * trained * trained_bytes / shard) + 4 * trained_tensors
    reference = math.ceil(counts.total * weight_bytes / shard) if cfg.algorithm.kl_coef > 0 and cfg.model.lora_rank == 0 else 0

    a = compute_bytes(cfg)
    t = arch.text
    h, layers, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    kinds = layer_types(t)
    thought_tokens, answer_tokens = cfg.rollout.max_thought_tokens, cfg.rollout.max_answer_tokens
    completion = thought_tokens + answer_tokens
    # a prompt's visual tokens: one image at model.max_pixels and its videos at the video budget's limit
    prompt_visual_tokens = visual_tokens(arch, cfg.model.max_pixels) + videos_per_prompt * video_tokens(
        arch, cfg.model.video_max_frames, cfg.model.video_max_pixels
    )
    prompt_tokens = prompt_visual_tokens + prompt_text_tokens
    sequence = prompt_tokens + completion
    micro = min(cfg.train.micro_batch_rows, rows)
    if cfg.model.gradient_checkpointing:  # rows re-encoded; layer inputs kept, one layer recomputed at a time
        recomputed = max(layer_bytes(arch, cfg, kind, micro, sequence, sequence) for kind in set(kinds))
        decoder = layers * micro * sequence * h * a + recomputed
        head = micro * completion * vocab * (a + 12)
    else:  # tree-shared: each prompt and thought of the micro-batch encoded once, every layer's tensors kept
        micro_prompts = min(prompts, math.ceil(micro / (k * m)))
        micro_thoughts = min(micro_prompts * k, math.ceil(micro / m))
        decoder = sum(
            kinds.count(kind) * tree_shared_layer_bytes(arch, cfg, prompts=micro_prompts, prompt_tokens=prompt_tokens, thoughts=micro_thoughts,
                                                        thought_tokens=thought_tokens, rows=micro, answer_tokens=answer_tokens, layer_type=kind)
            for kind in set(kinds)
        )  # fmt: skip
        head = (micro_thoughts * thought_tokens + micro * answer_tokens) * vocab * (a + 12)  # each thought scored once
    lora_casts = trained * a if cfg.model.lora_rank > 0 and a < trained_bytes else 0  # autocast's casts of the adapters
    vision = 0
    if not cfg.model.freeze_vision and cfg.model.lora_rank == 0:
        v = arch.vision
        width = v.get("embed_dim") or v["hidden_size"]
        # the tower's tokens are patches before merging: merge^2 per visual token (a video's, of
        # temporal_patch_size frames each)
        patches = prompt_visual_tokens * v["spatial_merge_size"] ** 2
        distinct_prompts = min(micro, prompts)  # rows of one prompt share its images' and videos' encoding
        # each distinct thought's crops, at most one image's tokens each (the processor's image budget)
        crop_patches = tool_images_per_thought * visual_tokens(arch, cfg.model.max_pixels) * v["spatial_merge_size"] ** 2
        distinct_thoughts = min(math.ceil(micro / m), prompts * k)
        vision = (distinct_prompts * patches + distinct_thoughts * crop_patches) * width * a * v["depth"]
    activations = decoder + head + lora_casts + vision

    kv_rows = prompts * (k * m + k)
    keys_values, recurrent_states = decode_cache_bytes(arch, cfg, kv_rows, sequence)
    kv_cache = keys_values + recurrent_states + prompts * k * m * vocab * 12
    gather = full_weights - weights if strategy == "fsdp" and processes > 1 else 0
    engine = engine_in_update = engine_weights = push_transient = 0
    if cfg.rollout.engine == "vllm" and role != "trainer":
        if device_bytes is None:
            raise ValueError("rollout.engine=vllm takes a share of the GPU's memory: give the GPU's size (device_bytes)")
        kv_cache = gather = recurrent_states = 0  # the engine samples in its own memory; the trainer's model is not gathered for it
        engine = math.ceil(cfg.rollout.vllm_gpu_memory_utilization * device_bytes)
        engine_in_update = 0 if cfg.rollout.vllm_sleep else engine
        engine_dtype_bytes = compute_bytes(cfg)  # the engine runs in bf16 under mixed precision, as the trainer computes
        engine_weights = math.ceil(counts.total * engine_dtype_bytes / cfg.rollout.vllm_tensor_parallel_size)
        push_transient = vocab * h * (4 + engine_dtype_bytes)
    return _as_role(MemoryEstimate(
        weights=weights, gradients=gradients, optimizer=optimizer, reference=reference, activations=activations,
        kv_cache=kv_cache, fsdp_rollout_gather=gather, gradients_between_steps=math.ceil(trained * trained_bytes / shard), trained_elements=trained, micro_batches_per_process=micro_batches,
        engine=engine, engine_in_update=engine_in_update, engine_weights=engine_weights, push_transient=push_transient,
        recurrent_states=recurrent_states,
    ), role, 0 if cfg.rollout.engine == "vllm" else counts.total * weight_bytes)  # fmt: skip


def _as_role(e: MemoryEstimate, role: str, model_bytes: int) -> MemoryEstimate:
    """``e`` for a split launch's ``role``: a trainer without what sampling holds; an engine with the whole model
    once (``model_bytes``: merged, so no adapters) and nothing that training holds."""
    if role == "trainer":
        return dataclasses.replace(e, kv_cache=0, recurrent_states=0, fsdp_rollout_gather=0, engine=0, engine_in_update=0, engine_weights=0, push_transient=0)
    if role == "engine":
        return dataclasses.replace(e, weights=model_bytes, gradients=0, optimizer=0, reference=0, activations=0, fsdp_rollout_gather=0,
                                   gradients_between_steps=0, trained_elements=0, micro_batches_per_process=0)  # fmt: skip
    return e


def verdict(peak: int, gpu_gb: float) -> str:
    """fits; tight (within the last 5%, which the CUDA context and the allocator's slack may take); no."""
    if peak <= TIGHT * gpu_gb * 1e9:
        return "fits"
    return "tight" if peak <= gpu_gb * 1e9 else "no"




def _with_tree(cfg: Config, thoughts: int, answers: int) -> Config:
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_thoughts=thoughts, num_answers=answers))


def tree_too_large(
    arch: Architecture, cfg: Config, processes: int, strategy: str, memory_bytes: int, *, videos_per_prompt: int = 0,
    tool_images_per_thought: int = 0, role: str = "both",
) -> str | None:  # fmt: skip
    """Why the run's K x M cannot fit in ``memory_bytes`` per process by this model's own estimate, naming the
    keys and the largest tree that fits; None when the estimated peak fits, or when even K = 2, M = 1 (the
    smallest tree a config allows) does not: then the model or the micro-batch is what is too large, not the
    tree, and the estimate leaves out what a user may add against that, such as offloading. Only the estimate's peak against the whole memory: the
    CUDA context and the allocator's slack are not counted, so a run this refuses cannot fit. ``videos_per_prompt``,
    ``tool_images_per_thought``, ``role``: as ``estimate``'s (a split launch's role is named in the message)."""
    k, m = cfg.rollout.num_thoughts, cfg.rollout.num_answers

    def peak(thoughts: int, answers: int) -> int:
        return estimate(arch, _with_tree(cfg, thoughts, answers), processes, strategy, videos_per_prompt=videos_per_prompt,
                        tool_images_per_thought=tool_images_per_thought, role=role).peak  # fmt: skip

    run = estimate(arch, cfg, processes, strategy, videos_per_prompt=videos_per_prompt, tool_images_per_thought=tool_images_per_thought, role=role)
    if run.peak <= memory_bytes or peak(2, 1) > memory_bytes:
        return None

    def fits(thoughts: int, answers: int) -> bool:
        return peak(thoughts, answers) <= memory_bytes

    answers = max((a for a in range(1, m + 1) if fits(k, a)), default=0)
    if answers:
        largest = f"With rollout.num_thoughts={k}, at most rollout.num_answers={answers} fits"
    else:
        thoughts = max(t for t in range(2, k + 1) if fits(t, 1))
        largest = f"With rollout.num_answers=1, at most rollout.num_thoughts={thoughts} fits"
    who = "" if role == "both" else f"{role} "  # a split launch: whose tree it is
    where = "" if role == "both" else f" on the {processes} {role} process(es)"
    return (
        f"rollout.num_thoughts x rollout.num_answers = {k} x {m} does not fit{where}: the memory model predicts a peak of "
        f"{run.peak / 1e9:.1f} GB per {who}process (rollout {run.rollout_peak / 1e9:.1f} GB, of which {run.kv_cache / 1e9:.1f} GB "
        f"of KV cache; update {run.update_peak / 1e9:.1f} GB) against {memory_bytes / 1e9:.1f} GB. {largest}; "
        f"fewer train.prompts_per_step{', more rollout.engine_processes' if role == 'engine' else ''} or shorter rollout.max_thought_tokens / max_answer_tokens also shrink it "
        f"(python -m vlm_grpo_ma.memory --config ...{'' if role == 'both' else ' --engine-processes N'} shows the parts)"
    )
