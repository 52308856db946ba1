"""Reference solutions for lesson 24's exercises (notebooks/24_long_context_memory.ipynb)."""

import torch
import torch.nn.functional as F

from hardway.exercises.lesson_24 import BUGS, planted_kernels
from hardway.models.gpt2 import causal_mask


# ---- Exercise 1: each suspect exposed by the smallest case that separates the three bugs
def _reference(q, k, v, causal=True, start=None):
    T, S, n_rep = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    start = S - T if start is None else start
    mask = causal_mask(T, S, start_pos=start) if causal else None
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1),
                                          attn_mask=mask)


def _differs(kernel, causal, T, S, k_tile, start=None) -> bool:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (T, S, S))
    return (kernel(q, k, v, causal=causal, start=start, k_tile=k_tile) - _reference(q, k, v, causal, start)
            ).abs().max().item() > 1e-4


def diagnose(kernel) -> str:
    if _differs(kernel, causal=False, T=16, S=16, k_tile=4):  # no mask, several key tiles: only the rescaling
        return BUGS[0]
    if _differs(kernel, causal=True, T=16, S=16, k_tile=64):  # causal, start 0, one key tile: the skip
        return BUGS[1]
    if _differs(kernel, causal=True, T=8, S=24, k_tile=64):  # causal after a prefix: the offset
        return BUGS[2]
    return "none found"


my_diagnosis = {name: diagnose(kernel) for name, kernel in planted_kernels().items()}


# ---- Exercise 2: a key and a value, per layer, per KV head, per position; int8 adds a 4-byte scale per head_dim
def my_kv_cache_bytes(n_layers, n_kv_heads, head_dim, n_positions, kv_cache_dtype, dtype):
    per_head = head_dim + 4 if kv_cache_dtype == "int8" else head_dim * dtype.itemsize
    return 2 * n_layers * n_kv_heads * n_positions * per_head


# ---- Exercise 3: the step is max|x| / 127; rounding to the nearest step moves a value by at most half of it
def my_error_bound(rows):
    return rows.abs().amax(dim=-1, keepdim=True) / 254
