"""Reference solutions to lesson 08's exercises (notebooks/08_kv_cache.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch


# Exercise 1: positions the model runs over. One forward pass per new token except after the last one:
# the naive loop runs prompt_len, prompt_len + 1, ..., prompt_len + max_new_tokens - 1 positions; the cached loop
# the prompt once, then one position per step.
def my_positions_processed(prompt_len, max_new_tokens, use_cache):
    if use_cache:
        return prompt_len + (max_new_tokens - 1)
    return sum(prompt_len + n for n in range(max_new_tokens))


# Exercise 2: KV bytes per token from config.json.
def my_kv_bytes_per_token(config, bytes_per_element):
    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    return 2 * config["num_hidden_layers"] * n_kv_heads * head_dim * bytes_per_element  # a key and a value


# Exercise 3: a sliding-window cache, a ring buffer of `window` slots per layer.
class MySlidingWindowCache:
    def __init__(self, n_layers, batch_size, window, n_kv_heads, head_dim, dtype=torch.float32):
        self.window = window
        shape = (n_layers, batch_size, n_kv_heads, window, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)  # slot s holds the latest position p with p % window == s
        self.v = torch.zeros(shape, dtype=dtype)

    def update(self, layer_idx, start_pos, k, v):
        T = k.shape[2]
        positions = torch.arange(start_pos, start_pos + T)  # (T,)
        self.k[layer_idx, :, :, positions % self.window] = k
        self.v[layer_idx, :, :, positions % self.window] = v
        end = start_pos + T
        kept = torch.arange(max(0, end - self.window), end)  # the positions to return, oldest first
        return self.k[layer_idx, :, :, kept % self.window], self.v[layer_idx, :, :, kept % self.window]


if __name__ == "__main__":  # exercise 2's questions about Llama 3 70B
    llama_3_70b = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8}
    for name, config in (("GQA, 8 KV heads", llama_3_70b), ("MHA, 64 KV heads", {**llama_3_70b,
                                                                                 "num_key_value_heads": 64})):
        per_token = my_kv_bytes_per_token(config, 2)  # bf16
        print(f"Llama 3 70B, {name}: {per_token:,} B/token, {per_token * 8192 / 2**30:.1f} GiB for 8192 tokens")
