"""Reference solutions to lesson 17's exercises (notebooks/17_weight_quantization.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch


# Exercise 1: half a byte a weight, plus an fp16 scale and an fp16 minimum for every group of every row.
def my_int4_bytes(out_features: int, in_features: int, group_size: int) -> int:
    return out_features * in_features // 2 + out_features * (in_features // group_size) * (2 + 2)


# Exercise 2: a row's step is its largest |w| / 127; rounding leaves an error spread evenly over one step, whose RMS
# is step / sqrt(12). Relative to ||w|| = sqrt(in) * RMS(w), and ||error|| = sqrt(in) * step / sqrt(12):
# error / ||w|| = (max |w| / RMS(w)) / (127 * sqrt(12)). The rows that lose most are those whose largest weight is
# the most times their typical one: outliers.
def my_int8_row_error(w: torch.Tensor) -> torch.Tensor:
    rms = w.pow(2).mean(dim=1).sqrt()  # (out,)
    step = w.abs().amax(dim=1) / 127  # (out,)
    return step / 12 ** 0.5 / rms
