"""Reference solutions to lesson 16's exercises (notebooks/16_gguf.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import numpy as np

# (weights per block, bytes per block) of each type the exercises ask about: sections 3 and 3b's tables.
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
          "Q5_1": (32, 24), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
          "Q6_K": (256, 210)}


# Exercise 1: suspect a returns the right values in the wrong places (a block's 32 weights, sorted, equal gguf's),
# with weight 0 still in its place and weight 1 holding weight 16's value: byte 0's two nibbles read as weights 0
# and 1, the nibble order. Suspect b is off by the same amount at every weight of a block, (d - 1) * m: a block of
# one constant value, whose q are all 0, shows w = d * m instead of m: the minimum added before scaling.
my_diagnosis = {"a": "nibble order", "b": "minimum added before scaling"}


# Exercise 2: whole blocks times the bytes of a block.
def my_tensor_bytes(type_name: str, dims: list[int]) -> int:
    block_size, block_bytes = BLOCKS[type_name]
    return int(np.prod(dims)) // block_size * block_bytes


# Exercise 3: every tensor is whole blocks (section 3's blocks of 32, section 3b's super-blocks of 256), and starts at
# the first multiple of the alignment after the one before it ends.
def my_data_bytes(tensors, alignment: int) -> int:
    end = 0
    for type_name, dims in tensors:
        start = -(-end // alignment) * alignment  # padded up to the alignment
        block_size, block_bytes = BLOCKS[type_name]
        end = start + int(np.prod(dims)) // block_size * block_bytes
    return end


# Exercise 4: Q4_K's 12 bytes. Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins). Sub-blocks 4-7:
# the low 4 bits from byte 8+j (scale in its low nibble, min in its high one), the top 2 bits from the 2 bits left
# over at the top of byte j (scale) and byte 4+j (min).
def my_unpack_scales_mins(packed: bytes):
    scales = [packed[j] & 63 for j in range(4)] + [(packed[8 + j] & 15) | ((packed[j] >> 6) << 4) for j in range(4)]
    mins = [packed[4 + j] & 63 for j in range(4)] + [(packed[8 + j] >> 4) | ((packed[4 + j] >> 6) << 4) for j in range(4)]
    return scales, mins
