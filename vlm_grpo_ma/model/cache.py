"""The KV cache as the model's forward takes it: the argument's name (it changed in transformers 5.20), a new
cache for the tree (``new_cache``: on a hybrid model its linear-attention layers can branch) and a preallocated
cache for decoding."""

from __future__ import annotations

import functools

import torch

from vlm_grpo_ma.model.loading import Policy


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


def new_cache(policy: Policy):
    """An empty cache for ``policy``'s model that the tree can repeat and select rows of: on a hybrid model
    (Qwen3.5) its linear-attention layers are ``linear_attention.BranchingLinearLayer``."""
    from transformers import DynamicCache

    from vlm_grpo_ma.model import linear_attention

    cache = DynamicCache(config=policy.model.config)
    if linear_attention.is_hybrid(policy.model.config):
        linear_attention.hybrid_cache_layers(cache)
    return cache


def _sampling_cache(policy: Policy, capacity: int | None):
    """A KV cache for decoding: with ``capacity`` (the longest sequence the rollout can reach) every layer
    writes into a buffer allocated once (``_preallocated_layer_class``) instead of growing by ``torch.cat`` at every
    token, which copies the whole cache each step. Models whose layers are not all plain dynamic ones (sliding
    windows, Qwen3.5's linear attention) keep ``new_cache``'s."""
    from transformers.cache_utils import DynamicLayer

    cache = new_cache(policy)
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
