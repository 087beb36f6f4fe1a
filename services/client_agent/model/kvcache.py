"""KV caches whose passes write their keys and values in place.

transformers' DynamicCache concatenates each layer's new keys and values to those it holds: a copy
of everything cached, in every layer, at every pass. A scoring pass on a cached prompt of hundreds
of tokens, or each token a generation writes after a prompt of thousands, copies the whole cache
for a few new positions (and under bf16 autocast in fp32, where cached keys are bf16 and new ones
fp32, for attention to cast back). Here each layer holds tensors with room for the positions to
come, and a pass writes after the last filled one; attention reads a view of the filled part."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # keys and values per layer, [rows, heads, positions, dim]


class Slots(DynamicLayer):
    """One layer's keys and values in tensors with room to spare ([rows, heads, capacity, dim]).
    `update` writes the new positions after the filled ones, in the tensors' dtype, and returns
    views of the filled part. Made empty (the first update allocates room for its positions and
    `reserve` more, in its keys' and values' own dtypes) or over tensors given (`filled` of their
    positions already written). A pass that does not fit moves the layer to tensors twice as large
    (a copy, as DynamicLayer makes at every pass)."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, filled: int = 0,
                 reserve: int = 0):
        super().__init__()
        self._reserve, self._filled = reserve, filled
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None
        if keys is not None:
            self._hold((keys, values))
            self.keys, self.values = keys[..., :filled, :], values[..., :filled, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self._filled + key_states.shape[-2]
        if self._slots is None or end > self._slots[0].shape[-2]:
            self._grow(key_states, value_states, end)
        keys, values = self._slots
        keys[..., self._filled:end, :] = key_states
        values[..., self._filled:end, :] = value_states
        self._filled = end
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        if self._slots is None:
            like, size = (key_states, value_states), end + self._reserve
        else:
            like, size = self._slots, max(end, 2 * self._slots[0].shape[-2])
        grown = tuple(t.new_empty((*t.shape[:-2], size, t.shape[-1])) for t in like)
        if self._slots is not None:
            for old, new in zip(self._slots, grown):
                new[..., :self._filled, :] = old[..., :self._filled, :]
        self._hold(grown)

    def _hold(self, slots: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._slots = slots
        self.dtype, self.device = slots[0].dtype, slots[0].device
        self.is_initialized = True


def _cache(layers: list[Slots]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = layers
    return cache


def pass_cache(like: KV, rows: int, filled: int, new: int) -> tuple[DynamicCache, KV]:
    """A cache for one pass of `new` positions a row after `filled` cached ones, and its
    uninitialised per-layer tensors (shaped and typed like `like`'s, [rows, heads, filled + new,
    dim]), whose first `filled` positions the caller writes the prefixes to before the pass."""
    layers = [(k.new_empty((rows, k.shape[1], filled + new, k.shape[3])),
               v.new_empty((rows, v.shape[1], filled + new, v.shape[3]))) for k, v in like]
    return _cache([Slots(k, v, filled) for k, v in layers]), layers


def generation_cache(config, reserve: int) -> DynamicCache:
    """A cache for `generate` with a model of `config`: the prompt's pass allocates room for the
    prompt and `reserve` more positions (the most tokens a generation writes), which each later
    token's pass fills. A model with layers of another kind (a sliding window, linear attention)
    gets transformers' own cache."""
    default = DynamicCache(config=config)
    if not default.layers or any(type(layer) is not DynamicLayer for layer in default.layers):
        return default
    return _cache([Slots(reserve=reserve) for _ in default.layers])
