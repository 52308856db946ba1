"""Reference solutions to lesson 06's exercises (notebooks/06_forward_pass.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch
import torch.nn.functional as F


# Exercise 1: GPT-2's parameter count, from config.json alone.
def my_gpt2_param_count(cfg):
    V, P, C, L = cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"]
    inner = cfg.get("n_inner") or 4 * C
    attention = (C * 3 * C + 3 * C) + (C * C + C)  # c_attn, c_proj: weights and biases
    mlp = (C * inner + inner) + (inner * C + C)  # c_fc, c_proj
    block = 2 * (2 * C) + attention + mlp  # ln_1 and ln_2 have a weight and a bias each
    return V * C + P * C + L * block + 2 * C  # wte (also the head), wpe, the blocks, ln_f


# Exercise 2: the logit lens: final norm and tied head applied to the stream after `layer` blocks.
@torch.no_grad()
def my_logit_lens(model, input_ids, layer):
    x = model.embed(input_ids)  # (B, T, C)
    for block in model.blocks[:layer]:
        x = block(x)  # (B, T, C)
    return F.linear(model.final_norm(x), model.wte.weight)  # (B, T, V)
