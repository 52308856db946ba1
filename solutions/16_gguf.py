"""Reference solutions to lesson 16's exercises (notebooks/16_gguf.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import struct

import numpy as np

# (weights per block, bytes per block) of each type the exercises ask about.
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}
# Metadata value type id -> struct format; 8 is a string, 9 an array.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


# Exercise 1: one Q4_1 block: fp16 d, fp16 m, then 16 bytes holding weights 0-15 (low nibbles) and 16-31 (high).
def my_dequantize_q4_1_block(block: bytes):
    d, m = struct.unpack("<ee", block[:4])
    q = [b & 0x0F for b in block[4:20]] + [b >> 4 for b in block[4:20]]
    return [float(np.float32(d) * np.float32(v) + np.float32(m)) for v in q]  # fp32 arithmetic, as ggml's


# Exercise 2: whole blocks times the bytes of a block.
def my_tensor_bytes(type_name: str, dims: list[int]) -> int:
    block_size, block_bytes = BLOCKS[type_name]
    return int(np.prod(dims)) // block_size * block_bytes


# Exercise 3: walk the header, the metadata and the tensor infos, then pad to the alignment.
def my_data_start(path) -> int:
    infos_end, alignment = walk_to_the_data(path)
    return -(-infos_end // alignment) * alignment


def walk_to_the_data(path) -> tuple[int, int]:
    """(where the tensor infos end, general.alignment or 32)."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 4 + 4
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16

    def string(pos):
        (n,) = struct.unpack_from("<Q", data, pos)
        return data[pos + 8:pos + 8 + n].decode(), pos + 8 + n

    def value(type_id, pos):
        if type_id == 8:
            return string(pos)
        if type_id == 9:
            item_type, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            items = []
            for _ in range(count):
                item, pos = value(item_type, pos)
                items.append(item)
            return items, pos
        fmt = SCALARS[type_id]
        return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)

    alignment = 32
    for _ in range(n_kv):
        key, pos = string(pos)
        (type_id,) = struct.unpack_from("<I", data, pos)
        v, pos = value(type_id, pos + 4)
        if key == "general.alignment":
            alignment = v
    for _ in range(n_tensors):
        _, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * n_dims + 4 + 8  # the dims, the type, the offset
    return pos, alignment


# Exercise 4: Q4_K's 12 bytes. Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins). Sub-blocks 4-7:
# the low 4 bits from byte 8+j (scale in its low nibble, min in its high one), the top 2 bits from the 2 bits left
# over at the top of byte j (scale) and byte 4+j (min).
def my_unpack_scales_mins(packed: bytes):
    scales = [packed[j] & 63 for j in range(4)] + [(packed[8 + j] & 15) | ((packed[j] >> 6) << 4) for j in range(4)]
    mins = [packed[4 + j] & 63 for j in range(4)] + [(packed[8 + j] >> 4) | ((packed[4 + j] >> 6) << 4) for j in range(4)]
    return scales, mins
