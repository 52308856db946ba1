"""Reference solutions to lesson 31's exercises (notebooks/31_sinks_and_mxfp4.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch


# Exercise 1: the sink is one more logit, appended after the keys; subtract each row's maximum (the sink keeps it
# finite, so a row whose keys are all -inf becomes zeros), softmax, drop the sink's column.
def my_sink_probs(scores, sink):
    H, T, S = scores.shape
    logits = torch.cat([scores, sink[:, None, None].expand(H, T, 1)], dim=-1)  # (H, T, S + 1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1)[..., :-1]  # (H, T, S)


# Exercise 2: byte 0 is the scale, 2^(b - 127); byte 1 + j holds element j in its low nibble and element j + 16 in
# its high one; a code's top bit is the sign, its low three bits index E2M1's magnitudes.
def my_mxfp4_block(raw):
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = torch.cat([raw[1:] & 0x0F, raw[1:] >> 4]).long()  # (32,): elements 0..15, then 16..31
    values = magnitudes[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    return values * 2.0 ** (int(raw[0]) - 127)
