"""Reference solutions to lesson 04's exercises (notebooks/04_attention.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import math

import torch


# Exercise 1: softmax(q kᵀ / √d, where the mask allows) v.
def my_attention(q, k, v, mask):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = scores.masked_fill(~mask, float("-inf"))  # (B, H, T, S): -inf where the query may not look
    return torch.softmax(scores, dim=-1) @ v  # (B, H, T, d)


# Exercise 2: the query at position p sees keys p - window + 1 .. p.
def my_sliding_window_mask(T, S, window):
    query_pos = (S - T + torch.arange(T))[:, None]  # (T, 1)
    key_pos = torch.arange(S)[None, :]  # (1, S)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)  # (T, S)


# Exercise 3: q, k, v per head straight from the file's [in, out] c_attn matrix.
def my_split_heads(c_attn_weight, c_attn_bias, x, n_head):
    B, T, C = x.shape
    d = C // n_head
    qkv = x @ c_attn_weight + c_attn_bias  # (B, T, C) @ (C, 3C) + (3C,) -> (B, T, 3C)
    q, k, v = qkv.split(C, dim=-1)  # each (B, T, C)
    return tuple(t.view(B, T, n_head, d).transpose(1, 2) for t in (q, k, v))  # each (B, H, T, d)
