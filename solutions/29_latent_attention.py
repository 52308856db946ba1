"""Reference solutions to lesson 29's exercises (notebooks/29_latent_attention.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch


# Exercise 1: MLA keeps kv_lora_rank + qk_rope_head_dim numbers per layer, for all heads together; plain attention a
# key (nope + rope) and a value per head per layer. bf16: 2 bytes a number.
def my_cache_bytes(config):
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    d_nope, d_rope, d_v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    mla = 2 * layers * (config["kv_lora_rank"] + d_rope)
    mha = 2 * layers * heads * (d_nope + d_rope + d_v)
    return mla, mha


# Exercise 2: q · [W_UK c; k_rope] = (q_nope W_UK) · c + q_rope · k_rope: W_UK moves to the query's side, once per
# query, and the S cached latents are read as they are.
def my_absorbed_scores(q_nope, q_rope, c_kv, k_rope, w_uk):
    q_latent = q_nope @ w_uk  # (T, r)
    return q_latent @ c_kv.T + q_rope @ k_rope.T  # (T, S)


# Exercise 3: biased scores choose (the groups by their two best, then the experts inside the kept groups); the
# unbiased scores of the chosen experts weigh, normalised to sum to 1.
def my_group_routing(scores, bias, n_group, topk_group, k):
    N, E = scores.shape
    biased = (scores + bias).view(N, n_group, E // n_group)  # (N, G, E / G)
    group_scores = biased.topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
    keep = torch.zeros(N, n_group, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    biased = biased.masked_fill(~keep[..., None], float("-inf")).view(N, E)
    experts = biased.topk(k, dim=-1).indices  # (N, k)
    weights = scores.gather(1, experts)  # (N, k)
    return weights / weights.sum(dim=-1, keepdim=True), experts
