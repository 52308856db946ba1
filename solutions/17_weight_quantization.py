"""Reference solutions to lesson 17's exercises (notebooks/17_weight_quantization.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch


# Exercise 1: half a byte a weight, plus an fp16 scale and an fp16 minimum for every group of every row.
def my_int4_bytes(out_features: int, in_features: int, group_size: int) -> int:
    return out_features * in_features // 2 + out_features * (in_features // group_size) * (2 + 2)


# Exercise 2: the row's largest |w| becomes 127; every weight is rounded to the nearest step.
def my_quantize_int8_row(row):
    scale = row.abs().max().item() / 127
    if scale == 0:
        return torch.zeros(row.shape, dtype=torch.int8), 0.0
    return torch.round(row / scale).clamp(-127, 127).to(torch.int8), scale
