"""Reference solutions to lesson 21's exercises (notebooks/21_mixture_of_experts.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch


# Exercise 1: the bytes one token's decode step reads.
def my_active_bytes(config, bytes_per_param):
    # Every weight a token multiplies by: attention, norms, the router and k experts in each sparse block, the dense
    # MLP in the others, the head. Not the embedding table (one row is read), not the E - k other experts.
    C, V, L = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    n_q, n_kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    d = config.get("head_dim") or C // n_q
    E = config.get("num_local_experts", config.get("num_experts"))
    k = config["num_experts_per_tok"]
    qwen3 = config["model_type"] == "qwen3_moe"
    expert_width = config["moe_intermediate_size"] if qwen3 else config["intermediate_size"]
    dense_layers = set(config.get("mlp_only_layers") or []) if qwen3 else set()
    step = config.get("decoder_sparse_step", 1) if qwen3 else 1
    attn = C * d * (2 * n_q + 2 * n_kv) + (2 * d if qwen3 else 0)  # q, k, v, o (+ Qwen3's q and k norms)
    total = C + V * C  # the final norm and the head (a tied head is the table: counted once, here)
    for i in range(L):
        sparse = i not in dense_layers and (i + 1) % step == 0
        mlp = C * E + k * 3 * C * expert_width if sparse else 3 * C * config["intermediate_size"]
        total += attn + mlp + 2 * C  # + the block's two norms
    return total * bytes_per_param
# The prediction: Qwen3-30B-A3B reads about 6.1 GB a token in bf16 against a dense 30B's 61 GB: at G GB/s (the
# lesson's table measures G), G / 6.1 tokens/s against G / 61, ten times as many, and both need 61 GB of memory.


# Exercise 2: top-k of the logits first, then a softmax over those k.
def my_route(logits, k):
    top_logits, experts = torch.topk(logits, k, dim=-1)  # (N, k) each, largest first
    return torch.softmax(top_logits.float(), dim=-1), experts
# The same as softmax -> top-k -> renormalise: softmax is monotonic, so the same k experts win, and
# exp(l_i) / sum_{j in top k} exp(l_j) is both results (the full softmax's denominator cancels in the division).
# Without renormalising (norm_topk_prob=false) it is not the same: those weights sum to less than 1.


# Exercise 3: the planted bug.
my_diagnosis = "weights swapped"
# How to find it: rows = mystery.blocks[0].mlp_norm(mystery.embed(ids))[0]; the gate's weights sum to 1 (so it is
# renormalised), do not change when a token is routed alone (so the softmax is over experts), and the block's output
# for a token is w2 * expert(e1) + w1 * expert(e2), not w1 * expert(e1) + w2 * expert(e2) (so the experts are right
# and their weights are exchanged).
