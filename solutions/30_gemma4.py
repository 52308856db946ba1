"""Reference solutions to lesson 30's exercises (notebooks/30_gemma4.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch


# Exercise 1: the layers before the shared ones read their own keys; a shared layer reads the last of those of its
# own type.
def my_kv_sources(layer_types, num_kv_shared_layers):
    first = len(layer_types) - num_kv_shared_layers
    last = {kind: i for i, kind in enumerate(layer_types[:first])}  # each type's last layer with keys of its own
    return [i if i < first else last[kind] for i, kind in enumerate(layer_types)]


# Exercise 2: a key and a value (both: keys as values still cache two tensors) per KV head, in the layers before the
# shared ones, each at its own head size; the full layers' own KV heads only with attention_k_eq_v.
def my_cache_bytes_per_token(config):
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types = list(types[:-1]) + ["full_attention"]  # the last layer is always full
    heads, dim = config.get("num_key_value_heads", 4), config.get("head_dim", 256)
    global_heads = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
    total = 0
    for kind in types[:n - config.get("num_kv_shared_layers", 0)]:
        full = kind == "full_attention"
        total += 2 * ((global_heads or heads) if full else heads) * (config.get("global_head_dim", 512) if full else dim)
    return 2 * total  # bf16


# Exercise 3: the first fraction · d/2 pairs turn with the frequencies of the whole head; the rest get 0.
def my_inv_freq(head_dim, rope_theta, fraction):
    n = int(fraction * head_dim // 2)
    turned = 1.0 / rope_theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float) / head_dim)
    return torch.cat([turned, torch.zeros(head_dim // 2 - n)])
