"""Reference solutions to lesson 19's exercises (notebooks/19_past_one_machine.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch
import torch.nn.functional as F

from hardway.models.gpt2 import gelu_tanh


# Exercise 1: a rank's rows of c_attn.
def my_shard_qkv(weight, bias, rank, world):
    # The rows are [q | k | v], each C long, heads side by side inside each: take the same slice of all three.
    C = weight.shape[1]
    lo, hi = rank * C // world, (rank + 1) * C // world
    rows = torch.cat([torch.arange(part * C + lo, part * C + hi) for part in range(3)])
    return weight[rows], bias[rows]


# Exercise 2: a rank's part of the MLP.
def my_mlp_partial(shard, x):
    # Column parallel then row parallel: GELU needs only this rank's own units; c_proj's bias waits for the sum.
    hidden = gelu_tanh(F.linear(x, shard.fc_weight, shard.fc_bias))  # (B, T, 4C / world)
    return F.linear(hidden, shard.fc_proj_weight)  # (B, T, C), no bias


# Exercise 3: the bytes each rank sends in one forward pass.
def my_bytes_sent(n_layer, n_embd, n_tokens, world, bytes_per_value):
    # Two all-reduces a block (attention, MLP), each of the (tokens, C) residual stream; a ring all-reduce sends
    # 2(w - 1)/w of it from every rank: a reduce-scatter, then an all-gather.
    return 2 * n_layer * 2 * (world - 1) / world * n_tokens * n_embd * bytes_per_value
