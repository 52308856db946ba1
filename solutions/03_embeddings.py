"""Reference solutions to lesson 03's exercises (notebooks/03_embeddings.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""


import torch
import torch.nn.functional as F


# Exercise 1: token embeddings by a one-hot matmul, plus the position embeddings from start_pos.
def my_embed(wte, wpe, input_ids, start_pos):
    one_hot = F.one_hot(input_ids, num_classes=wte.shape[0]).to(wte.dtype)  # (B, T, V)
    positions = start_pos + torch.arange(input_ids.shape[1])  # (T,)
    return one_hot @ wte + wpe[positions]  # (B, T, V) @ (V, C) + (T, C) -> (B, T, C)


# Exercise 2: the original Transformer's sinusoidal position table.
def my_sinusoidal(n_pos, dim):
    p = torch.arange(n_pos, dtype=torch.float64)[:, None]  # (n_pos, 1)
    i = torch.arange(dim // 2, dtype=torch.float64)[None, :]  # (1, dim/2)
    angle = p / 10000 ** (2 * i / dim)  # (n_pos, dim/2)
    table = torch.empty(n_pos, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()  # (n_pos, dim)
