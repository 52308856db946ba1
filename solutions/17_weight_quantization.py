"""Reference solutions to lesson 17's exercises (notebooks/17_weight_quantization.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch


# Exercise 1: a decoded token reads every linear layer in full, quantized: the integers (1 byte a weight in int8,
# half a byte in int4), an fp16 scale for every group of every row (a group is the whole row for int8 without a
# group size) and, in int4, an fp16 minimum beside it; the biases and the norms stay fp32 and are read too. The
# embedding table is looked up one row a token: stored, not read. A tied head is a Linear like the others: it gets
# its own quantized copy, which every token reads.
def my_bytes_read(model, bits, group_size):
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            out_features, in_features = module.weight.shape
            group = in_features if bits == 8 and group_size is None else (group_size or 32)
            groups = out_features * (in_features // group)
            total += out_features * in_features * bits // 8 + groups * (2 + (2 if bits == 4 else 0))
            total += 0 if module.bias is None else module.bias.nbytes
        elif not isinstance(module, torch.nn.Embedding):
            total += sum(p.nbytes for p in module.parameters(recurse=False))  # the norms' weights
    return total


# Exercise 2: a row's step is its largest |w| / 127; rounding leaves an error spread evenly over one step, whose RMS
# is step / sqrt(12). Relative to ||w|| = sqrt(in) * RMS(w), and ||error|| = sqrt(in) * step / sqrt(12):
# error / ||w|| = (max |w| / RMS(w)) / (127 * sqrt(12)). The rows that lose most are those whose largest weight is
# the most times their typical one: outliers.
def my_int8_row_error(w: torch.Tensor) -> torch.Tensor:
    rms = w.pow(2).mean(dim=1).sqrt()  # (out,)
    step = w.abs().amax(dim=1) / 127  # (out,)
    return step / 12 ** 0.5 / rms
