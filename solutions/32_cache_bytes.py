"""Reference solutions to lesson 32's exercises (notebooks/32_cache_bytes.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import math


# Exercise 1: whole blocks of 16, from the block of the first position a query from here on still reads (n - W + 1)
# to the block of the last position; every block before that has gone back to the pool.
def my_windowed_bytes(n_layers, n_kv_heads, head_dim, window, n_positions):
    per_block = 16 * n_layers * 2 * n_kv_heads * head_dim * 2  # a key and a value, bf16, every layer
    first_read = max(n_positions - window + 1, 0)
    return (math.ceil(n_positions / 16) - first_read // 16) * per_block


# Exercise 2: the latent and one rope key a position and layer, against a key (nope + rope) and a value per head.
def my_latent_bytes(config):
    L, H = config["num_hidden_layers"], config["num_attention_heads"]
    latent = L * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    per_head = L * H * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]) * 2
    return latent, per_head


# Exercise 3: the batch multiplies the cache, not the weights; a cache that stops growing may never get there.
def my_cache_crossover(n_params, cost, batch_size):
    weights = 2 * n_params  # bf16
    if cost.full_block_bytes == 0 and batch_size * cost.bytes(10 * (cost.window or 1) + 64) < weights:
        return None  # past its window the cost is flat
    n = 1
    while batch_size * cost.bytes(n) < weights:  # by blocks first, then position by position
        n += 16
    while n > 1 and batch_size * cost.bytes(n - 1) >= weights:
        n -= 1
    return n
