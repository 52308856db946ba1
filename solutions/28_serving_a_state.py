"""Reference solutions to lesson 28's exercises (notebooks/28_serving_a_state.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""


# Exercise 1: the file's order is tiled, the key head changing fastest: read the rows as (n_v / n_k copies, n_k key
# heads, d rows) and swap the first two axes, so that each key head's value heads come together.
def my_restore_value_heads(rows, n_k, n_v):
    d = rows.shape[0] // n_v  # rows a value head
    tiled = rows.reshape(n_v // n_k, n_k, d, *rows.shape[1:])  # (copy, key head, d, ...)
    return tiled.transpose(0, 1).reshape(rows.shape)  # (key head, copy, d, ...) flattened: the hub's order


# Exercise 2: the hub's value head j is key head j // r's copy j % r (r = n_v / n_k); the file put that copy at
# head (j % r) * n_k + j // r. A head is d_v / width blocks, which move together, if d_v is a multiple of width.
def my_out_proj_blocks(n_k, n_v, d_v, width):
    if n_k in (1, n_v):  # tiled and grouped are the same order: nothing moved
        return list(range(n_v * d_v // width))
    if d_v % width:  # a block holds parts of two heads
        return None
    per_head, r = d_v // width, n_v // n_k
    order = []
    for j in range(n_v):  # the hub's heads, in order
        in_file = (j % r) * n_k + j // r
        order += [in_file * per_head + b for b in range(per_head)]
    return order


# Exercise 3: the pool holds keys and values of the full-attention layers only (every 4th when layer_types is absent),
# in the model's dtype, n_blocks * block_size positions (and one scratch slot, lesson 14: within the check's 0.5%).
# Beside it, max_batch state slots, allocated up front: per Gated DeltaNet layer a convolution state of K - 1 inputs
# of 2 key_dim + value_dim channels and one (d_k, d_v) matrix per value head, in fp32 whatever the model's dtype.
def my_engine_cache_bytes(config, n_blocks, block_size, max_batch, value_bytes):
    n = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                for i in range(n)]
    n_attention = layer_types.count("full_attention")
    pool = (2 * n_attention * n_blocks * block_size * config.get("num_key_value_heads", 4)
            * config.get("head_dim", 256) * value_bytes)
    h_k, h_v = config.get("linear_num_key_heads", 16), config.get("linear_num_value_heads", 32)
    d_k, d_v = config.get("linear_key_head_dim", 128), config.get("linear_value_head_dim", 128)
    conv_dim = 2 * h_k * d_k + h_v * d_v
    slot = (n - n_attention) * (conv_dim * (config.get("linear_conv_kernel_dim", 4) - 1) + h_v * d_k * d_v) * 4
    return pool + max_batch * slot
