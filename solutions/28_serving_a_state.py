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
