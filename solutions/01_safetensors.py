"""Reference solutions to lesson 01's exercises (notebooks/01_safetensors.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import json

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


# Exercise 1: the header and where the data starts.
def my_read_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")  # unsigned 64-bit, little-endian
        header = json.loads(f.read(n))
    return header, 8 + n


# Exercise 2: one tensor, reading only its bytes.
def my_load_tensor(path, name):
    header, data_start = my_read_header(path)
    info = header[name]
    dtype, shape = DTYPES[info["dtype"]], info["shape"]
    begin, end = info["data_offsets"]
    if begin == end:  # no bytes: torch.frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        raw = bytearray(f.read(end - begin))
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


# Exercise 3: refuse a corrupt file (lesson 01's rules, in short).
def my_check_file(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError("shorter than the 8-byte header size")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError(f"header size {n} runs past the end of the file")
    header = json.loads(data[8:8 + n])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not all(isinstance(v, str) for v in info.values()):
                raise ValueError("__metadata__ must map strings to strings")
            continue
        begin, end = info["data_offsets"]
        numel = 1
        for d in info["shape"]:
            if not isinstance(d, int) or d < 0:
                raise ValueError(f"{name}: bad shape {info['shape']}")
            numel *= d
        if end - begin != numel * DTYPES[info["dtype"]].itemsize:  # an unknown dtype is a KeyError
            raise ValueError(f"{name}: data_offsets do not hold shape x dtype bytes")
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):  # the tensors must tile the data: no gap, no overlap, nothing after
        if begin != position:
            raise ValueError(f"a tensor begins at {begin}, expected {position}")
        position = end
    if position != len(data) - 8 - n:
        raise ValueError("the tensors do not cover the data exactly")
