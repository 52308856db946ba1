"""Reference solutions to lesson 05's exercises (notebooks/05_transformer_block.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import math

import torch


# Exercise 1: GPT-2's tanh GELU, in transformers' gelu_new order of operations.
def my_gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# Exercise 2: the 2017 Transformer's post-norm block: normalise after each residual addition.
def my_post_norm_block(block, x):
    h = block.ln_1(x + block.attn(x))  # (B, T, C)
    return block.ln_2(h + block.mlp(h))  # (B, T, C)
