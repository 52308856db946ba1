"""Reference solutions to lesson 11's exercises (notebooks/11_verification_ritual.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch

from hardway.verify.ritual import TOLERANCE, attention_diffs, first_divergent_layer, hidden_state_diffs


# Exercise 1: each position's error against its own size, in fp32.
def my_relative_divergence(h, h_ref):
    h, h_ref = h.float(), h_ref.float()  # (B, T, C)
    return (h - h_ref).norm(dim=-1) / h_ref.norm(dim=-1)  # (B, T)


# Exercise 2: the first layer whose output diverges, by the relative measure; hidden state i + 1 is layer i's output.
def my_find_broken_layer(model, reference, input_ids):
    relative = hidden_state_diffs(model, reference, input_ids).relative  # one value per hidden state
    tol = TOLERANCE[model.lm_head.weight.dtype].hidden_state
    return first_divergent_layer(relative, tol)  # already a layer number: stage i + 1 -> layer i


# Exercise 3: the signatures of the five causes, most telling first.
def my_diagnose(model, reference, input_ids):
    diffs = hidden_state_diffs(model, reference, input_ids)
    layer0 = attention_diffs(model, reference, input_ids, layer=0)  # max |Δ| of q, k, v, probabilities
    tol = TOLERANCE[torch.float32].hidden_state
    if max(diffs.relative) < 1e-2:  # small everywhere, from layer 0 on: a norm slightly off
        return "RMSNorm epsilon placement"
    if layer0["v"] > tol:  # v is wrong: the input of attention is, so a weight (the norm's) is in the wrong place
        return "weight-name map"
    if layer0["q"] > tol:  # q and k wrong, v right: only RoPE touches q and k alone
        return "RoPE convention"
    if diffs.per_position[1, -1] <= tol:  # q, k, v right; layer 0 right at the last position only: it sees all anyway
        return "causal mask"
    return "GQA broadcasting"  # q, k, v right, every position wrong: the heads read the wrong KV head
