"""Reference solutions to lesson 12's exercises (notebooks/12_fast_decode.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch

from hardway.instruments.memory import weight_bytes


# Exercise 1: every distinct weight byte once, plus the cache's bytes for `context_len` positions.
def my_roofline_tokens_per_s(model, bandwidth, context_len):
    per_position = model.new_kv_cache(batch_size=1, max_len=1).nbytes  # K and V of every layer for one position
    return bandwidth / (weight_bytes(model) + context_len * per_position)


# Exercise 2: predictions, (graphs compiled for the calls, whether a graph reads the position back to the host).
my_predictions = {
    "int_slice": (3, False),  # a Python int is a constant of the graph: a guard on its value, a new graph per position
    "item_slice": (1, True),  # the tensor keeps one graph, but int(pos) copies the number out at every call
    "index_copy": (1, False),  # the position is data: same shapes, same graph, nothing read back
    "where_row": (1, False),  # the mask row is computed from the tensor on the device: the same
    "index_copy_after_prefill": (2, False),  # guards check shapes: the 3-token prefill is a graph of its own
}
