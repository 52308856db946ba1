"""The paged cache of a latent-attention model (lesson 29): lesson 14's pool of blocks, each holding block_size
positions of every layer's latent and rotated key, and no values."""

from __future__ import annotations

import torch

from hardway.engine.paged_cache import PagedKVCache
from hardway.errors import ConfigError
from hardway.loading import CausalLM
from hardway.models.latent_attention import LatentCache


class LatentPagedCache(PagedKVCache):
    """PagedKVCache whose pool of each layer is `k` (n_blocks * block_size + 1, 1, kv_lora_rank + rope_dim): one
    position's latent and rope key per slot, and no `v` pool (an empty list). `update` has LatentCache's interface:
    it writes the new latents (B, 1, T, r + d_rope), ignores v, and returns (the rows' latents gathered through
    their slot mappings, (B, 1, S, r + d_rope), None). Blocks are blocks: lesson 15's prefix caching shares them as
    it shares keys and values."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int, width: int, dtype: torch.dtype = torch.float32,
                 device="cpu"):
        super().__init__(n_layers, 0, block_size, 1, width, dtype, device)  # the settings; no pools yet
        self.scratch_slot = n_blocks * block_size
        self.k = [torch.zeros(self.scratch_slot + 1, 1, width, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = []  # n_layers x (n_slots + 1, 1, r + d_rope) above; nothing for values

    @classmethod
    def for_model(cls, model: CausalLM, n_blocks: int, block_size: int, sliding_layers=(),
                  n_sliding_blocks: int = 0) -> LatentPagedCache:
        probe = model.new_kv_cache(1, 1)  # a LatentCache: the model's layers, latent width, dtype and device
        return cls(probe.n_layers, n_blocks, block_size, probe.head_dim, probe.k.dtype, probe.k.device)

    def bytes_per_block(self, sliding: bool = False) -> int:
        """block_size positions of latent and rope key in every layer: half of what keys and values of one such
        head would take, and 1/(2H) of what H expanded heads would."""
        return 0 if sliding else self.n_layers * self.block_size * self.head_dim * self.k[0].element_size()

    def update(self, layer_idx: int, start_pos: int, k: torch.Tensor, v: torch.Tensor | None = None):
        """k (B, 1, T, r + d_rope) -> (the rows' latents so far (B, 1, S, r + d_rope), None)."""
        B, _, T, d = k.shape
        if (B, T) != (self.batch_size, self.n_new):
            raise ValueError(f"LatentPagedCache.update: got {B} rows of {T} new positions, but bind() prepared "
                             f"{self.batch_size} rows of {self.n_new}")
        k = k.reshape(B * T, 1, d)  # (B * T, 1, d): row after row
        if not self.all_new:
            k = k.index_select(0, self.new_rows)  # (sum(n_new), 1, d): the new columns only
        pool = self.k[layer_idx]  # (n_slots + 1, 1, d)
        pool.index_copy_(0, self.write_slots, k)
        S = self.read_slots.shape[1]
        return pool.index_select(0, self.read_slots.flatten()).view(B, 1, S, d), None  # (B, 1, S, d)


def paged_cache_class(model: CausalLM, cache_class: type) -> type:
    """The pool class for `model`: LatentPagedCache when the model's own cache is a LatentCache (lesson 29), else
    cache_class as chosen. An int8 pool for a latent is a ConfigError: this engine quantizes keys and values only."""
    if not isinstance(model.new_kv_cache(1, 1), LatentCache):
        return cache_class
    if cache_class is not PagedKVCache:
        raise ConfigError(f"a {cache_class.__name__} pool is not available for latent attention: its pool keeps the "
                          f"model's dtype")
    return LatentPagedCache
