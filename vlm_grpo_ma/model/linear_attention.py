"""Qwen3.5's linear-attention layers (Gated DeltaNet) made to branch and to continue the way the tree needs.

In a hybrid model 3 of every 4 decoder layers keep no keys and values: their cache is a causal-conv state (the
last ``kernel`` inputs of the layer's convolution) and a recurrent state [value heads, key dim, value dim]. The
tree is built on two operations, and transformers' layer (5.25) supports neither as the tree uses them:

1. Padding. The tree pads rows: prompts on the left for sampling and on the right for training, thoughts and
   answers on the right, and a row that finished its thought is fed pad tokens while the others decode. The
   attention mask keeps a pad out of the attention layers, but in a Gated DeltaNet layer a pad still decays the
   recurrent state and shifts the conv state (transformers zeroes pad inputs in multi-token forwards only, and
   in one-token decode steps not at all). ``masked_gated_delta_forward`` makes a pad a no-op: its decay is 1
   (log-decay 0), its write strength 0, and each row's conv state is cut at its last real token. Exact for pads
   at either end of a block, which is where the tree puts them.
2. Gradients through the cache. transformers copies each new state into a fixed buffer in place (for CUDA
   graphs); the next block's forward then overwrites what the last one saved for backward. Here each state is
   replaced by a new tensor, so the training forward's gradients flow from an answer back through the state its
   thought ended in, as they do through the keys and values of attention layers.

``BranchingLinearLayer`` adds the batch operations ``DynamicCache`` applies to every layer when the tree
repeats or selects rows (``batch_repeat_interleave``, ``batch_select_indices``), which transformers' linear
layer lacks. ``hybrid_cache_layers`` swaps them into a new cache; ``install`` swaps the forward into a model.
Which rows of a block are real reaches the layers through the cache (``mark_block``): a one-token decode step
gets no 2D mask from the model.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from vlm_grpo_ma.model.architectures import LINEAR_ATTENTION


def is_hybrid(config) -> bool:
    """Whether the (text) config has linear-attention layers (Qwen3.5, dense and MoE)."""
    text = getattr(config, "text_config", config)
    return LINEAR_ATTENTION in (getattr(text, "layer_types", None) or ())


def mark_block(cache, block_mask: torch.Tensor) -> None:
    """Tell the linear-attention layers which positions of the next block are real: ``block_mask`` [N, W], 1 for
    a real token, 0 for a pad. Every forward on a hybrid cache is preceded by one (``masked_gated_delta_forward``
    refuses a cache whose mark does not match the block's shape)."""
    cache.linear_block_mask = block_mask


def _block_mask(cache, attention_mask, batch: int, width: int, device) -> torch.Tensor:
    """The real positions [N, W] of this block: the cache's mark, else the model's 2D mask for the block
    (transformers passes it trimmed to the block, or None when nothing is padded), else all real."""
    marked = getattr(cache, "linear_block_mask", None) if cache is not None else None
    if marked is not None:
        if tuple(marked.shape) != (batch, width):
            raise ValueError(f"the cache's block mark is {tuple(marked.shape)} for a block of {(batch, width)}: mark_block before each forward")
        return marked.to(device)
    if attention_mask is not None and attention_mask.ndim == 2:
        return attention_mask[:, -width:].to(device)
    return torch.ones((batch, width), dtype=torch.long, device=device)


def _last_real_window(window: torch.Tensor, real: torch.Tensor, kernel: int) -> torch.Tensor:
    """The conv state after a block: for each row the ``kernel`` inputs ending at its last real token.
    ``window`` [N, C, kernel + W] is the previous state followed by the block's inputs, ``real`` [N, W]."""
    width = real.shape[1]
    positions = torch.arange(width, device=real.device)
    last = torch.where(real.bool(), positions, -1).amax(dim=1)  # -1: no real token, the state is unchanged
    end = last + kernel  # index in window of the last real input (kernel - 1: the previous state's last)
    index = end[:, None] + torch.arange(-kernel + 1, 1, device=real.device)[None, :]  # [N, kernel]
    return window.gather(2, index[:, None, :].expand(-1, window.shape[1], -1))


def _delta_rules(module):
    """The chunked and the one-step gated delta rule of ``module``'s own modeling file (Qwen3.5 and its MoE
    each define theirs; transformers routes them to hub kernels where those are installed)."""
    source = sys.modules[type(module).__module__]
    return source.torch_chunk_gated_delta_rule, source.torch_recurrent_gated_delta_rule


def masked_gated_delta_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
    """The Gated DeltaNet layer's forward (transformers' ``Qwen3_5GatedDeltaNet.forward``, same weights and
    arithmetic) for any block length after any cache, with pads as no-ops and states replaced, not copied into
    (module docstring). ``self`` is the layer."""
    from transformers.activations import ACT2FN

    batch, width, _ = hidden_states.shape
    real = _block_mask(cache, attention_mask, batch, width, hidden_states.device)
    layer = cache.layers[self.layer_idx] if cache is not None else None
    inputs = hidden_states * real[..., None].to(hidden_states.dtype)
    mixed = self.in_proj_qkv(inputs).transpose(1, 2)  # [N, C, W]
    gate = self.in_proj_z(inputs).reshape(batch, width, -1, self.head_v_dim)
    write_logit, decay_logit = self.in_proj_b(inputs), self.in_proj_a(inputs)

    kernel = self.conv_kernel_size
    if layer is not None and layer.is_conv_states_initialized[0]:
        previous_conv = layer.conv_states[0].to(mixed.dtype)
    else:
        previous_conv = mixed.new_zeros((batch, mixed.shape[1], kernel))  # what the causal conv pads with
    window = torch.cat([previous_conv, mixed], dim=-1)  # [N, C, kernel + W]
    # output i of the block reads window[i + 1 : i + 1 + kernel]: drop the output that ends in the previous state
    convolved = F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[..., 1:]
    convolved = ACT2FN[self.activation](convolved).transpose(1, 2)
    query, key, value = torch.split(convolved, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, width, -1, self.head_k_dim)
    key = key.reshape(batch, width, -1, self.head_k_dim)
    value = value.reshape(batch, width, -1, self.head_v_dim)
    # a pad writes nothing (beta 0) and keeps the state (log-decay 0)
    beta = write_logit.sigmoid() * real[..., None].to(write_logit.dtype)
    log_decay = -self.A_log.float().exp() * F.softplus(decay_logit.float() + self.dt_bias) * real[..., None].float()

    initial = layer.recurrent_states[0] if layer is not None and layer.is_recurrent_states_initialized[0] else None
    chunked, one_step = _delta_rules(self)
    rule = one_step if width == 1 and initial is not None else chunked
    core, final_state = rule(
        query, key, value, g=log_decay, beta=beta, initial_state=initial,
        output_final_state=layer is not None, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    if layer is not None:
        _replace_states(layer, _last_real_window(window, real, kernel), final_state, width)

    core = self.norm(core.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch, width, -1))


def _replace_states(layer, conv_state: torch.Tensor, recurrent_state: torch.Tensor, width: int) -> None:
    """Put a block's final states into a cache layer as new tensors (autograd keeps the old ones)."""
    layer.conv_states[0], layer.recurrent_states[0] = conv_state, recurrent_state
    layer.conv_kernel_size[0] = conv_state.shape[-1]
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.device, layer.dtype = conv_state.device, conv_state.dtype
    layer.cumulative_length_linear = layer.cumulative_length_linear.to(conv_state.device) + width


def install(model: torch.nn.Module) -> int:
    """Give every Gated DeltaNet layer of ``model`` the masked forward (a subclass of its own class, so copies,
    wrappers and hooks see an ordinary module). Returns how many layers it changed."""
    changed = 0
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            module.__class__ = _masked_class(type(module))
            changed += 1
    return changed


@functools.cache
def _masked_class(base: type) -> type:
    return type(f"Masked{base.__name__}", (base,), {"forward": masked_gated_delta_forward, "__module__": base.__module__})


@functools.cache
def _branching_layer_class():
    """The cache layer of a linear-attention layer, with the batch operations of the tree (built on first use:
    transformers is imported lazily)."""
    from transformers.cache_utils import LinearAttentionLayer

    class BranchingLinearLayer(LinearAttentionLayer):
        """transformers' linear-attention cache layer plus the row operations DynamicCache applies to every layer."""

        def _map_states(self, function) -> None:
            for i in range(self.number_of_states):
                if self.is_conv_states_initialized[i]:
                    self.conv_states[i] = function(self.conv_states[i])
                if self.is_recurrent_states_initialized[i]:
                    self.recurrent_states[i] = function(self.recurrent_states[i])

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._map_states(lambda state: state.repeat_interleave(repeats, dim=0))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._map_states(lambda state: state[indices.to(state.device), ...])

    return BranchingLinearLayer


def hybrid_cache_layers(cache) -> None:
    """Swap the linear-attention layers of a new ``DynamicCache`` for ``BranchingLinearLayer`` (in place)."""
    from transformers.cache_utils import LinearAttentionLayer

    layer_class = _branching_layer_class()
    cache.layers = [layer_class() if type(layer) is LinearAttentionLayer else layer for layer in cache.layers]
