"""Reference solutions to lesson 12's exercises (notebooks/12_fast_decode.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch

from hardway.memory import weight_bytes


# Exercise 1: every distinct weight byte once, plus the cache's bytes for `context_len` positions.
def my_roofline_tokens_per_s(model, bandwidth, context_len):
    per_position = model.new_kv_cache(batch_size=1, max_len=1).nbytes  # K and V of every layer for one position
    return bandwidth / (weight_bytes(model) + context_len * per_position)


# Exercise 2: write at a position tensor with index_copy_, return every slot.
def my_static_update(k_cache, v_cache, start_pos, k, v):
    positions = start_pos + torch.arange(k.shape[2], device=k.device)  # (T,)
    k_cache.index_copy_(2, positions, k)  # (B, H, max_len, d), in place
    v_cache.index_copy_(2, positions, v)
    return k_cache, v_cache
