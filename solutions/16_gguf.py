"""Reference solutions to lesson 16's exercises (notebooks/16_gguf.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import struct

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


# Exercise 4: one Q6_K super-block by hand. Two halves of 128 weights; in half h, weight r's low 4 bits are in byte
# 64 h + r % 64 of the first 128 (its low nibble for r < 64, its high nibble after), its high 2 bits in byte
# 32 h + r % 32 of the next 64, at bits 2 (r // 32) and 2 (r // 32) + 1; scale i // 16 (int8) for weight i; d last.
def my_q6_k_weights(block: bytes):
    ql, qh = block[:128], block[128:192]
    scales = struct.unpack("<16b", block[192:208])
    (d,) = struct.unpack("<e", block[208:210])
    weights = []
    for i in range(256):
        h, r = divmod(i, 128)
        low = ql[64 * h + r % 64]
        low = low & 15 if r < 64 else low >> 4
        high = (qh[32 * h + r % 32] >> (2 * (r // 32))) & 3
        q = low | (high << 4)
        weights.append(float(np.float32(np.float32(d) * np.float32(scales[i // 16])) * np.float32(q - 32)))
    return weights
