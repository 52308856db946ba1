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
