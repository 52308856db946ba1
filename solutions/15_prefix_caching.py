"""Reference solutions to lesson 15's exercises (notebooks/15_prefix_caching.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import hashlib
from array import array


# Exercise 1: the block key.
def my_block_key(prev_key, token_ids):
    # The previous key stands for every token before this block, so equal keys mean equal prefixes; SHA-256, so that
    # two different prefixes never meet on one key (a collision would hand a request someone else's keys and values).
    return hashlib.sha256(prev_key + array("q", token_ids).tobytes()).digest()


# Exercise 2: the longest cached prefix.
def my_match_prefix(blocks, token_ids):
    bs, key, found = blocks.block_size, b"", []
    for i in range((len(token_ids) - 1) // bs):  # full blocks only, and never the last token: its logits are needed
        key = blocks.block_key(key, token_ids[i * bs:(i + 1) * bs])  # chained: the key names the whole prefix
        block = blocks.cached.get(key)
        if block is None:
            break  # the first miss ends the prefix: a table with a hole would read the wrong keys and values
        found.append(block)
    return found
