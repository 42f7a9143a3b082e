"""Key/value cache for incremental decoding: each new token runs one position through the model.

The cache is per layer, not per block: the layers that share a block (pseudo model) see different hidden states, so
their keys and values differ although their weights are the same. A layer's buffers are allocated on its first
call, in the dtype and device of its keys (autocast may make them bf16). Positions are absolute: a call feeds the
tokens at positions ``[length, length + new)``, each layer stores its keys and values there and attends to the
positions up to them, and the model advances ``length`` once every layer has run.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for the first ``length`` positions of a batch of sequences.

    Args:
        num_layers: layers of the model (one cache slot each).
        capacity: positions the buffers hold; a model refuses to run past them (and past its ``max_seq_len``).
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"KVCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.length = 0
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers

    def layer(self, index: int) -> LayerKV:
        """The view of layer ``index``'s slot that its attention reads and writes."""
        return LayerKV(self, index)

    def check_room(self, new: int) -> None:
        if self.length + new > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions: {self.length} are filled, {new} more do "
                             "not fit")

    def store(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``index``'s keys and values (batch, heads, new, head_dim) at positions ``[length, length +
        new)``; return the keys and values of every position up to them, ``[0, length + new)``."""
        start, end = self.length, self.length + keys.shape[2]
        self.check_room(keys.shape[2])
        if self._keys[index] is None:
            batch, heads, _, head_dim = keys.shape
            self._keys[index] = keys.new_zeros(batch, heads, self.capacity, head_dim)
            self._values[index] = values.new_zeros(batch, heads, self.capacity, head_dim)
        key_buffer, value_buffer = self._keys[index], self._values[index]
        key_buffer[:, :, start:end] = keys
        value_buffer[:, :, start:end] = values
        return key_buffer[:, :, :end], value_buffer[:, :, :end]

    def advance(self, new: int) -> None:
        """Count ``new`` more positions as filled (the model calls this after its last layer)."""
        self.check_room(new)
        self.length += new


class LayerKV:
    """One layer's slot of a :class:`KVCache`: where the attention of that layer stores and reads its keys."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.index = index

    @property
    def start(self) -> int:
        """Position of the first token of this call."""
        return self.cache.length

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.store(self.index, keys, values)
