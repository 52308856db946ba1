"""Reference solutions to lesson 14's exercises (notebooks/14_serving.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""


# Exercise 1: where a sequence's position lives in the pool of blocks.
def my_slot_of(block_table, position, block_size):
    block = block_table[position // block_size]  # which block holds it
    return block * block_size + position % block_size  # that block's first slot, plus the offset inside it


# Exercise 2: cut the text before the earliest stop string.
def my_apply_stop(text, stop):
    starts = [text.find(s) for s in stop if s in text]
    if not starts:
        return text, False
    return text[:min(starts)], True
