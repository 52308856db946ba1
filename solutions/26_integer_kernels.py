"""Reference solutions to lesson 26's exercises (notebooks/26_integer_kernels.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch

# Exercise 1: bytes per block x 8 / weights per block. Q8_0: 34 B / 32; Q5_0: 22 B / 32; Q4_K: 144 B / 256 (2 + 2
# bytes of d and dmin, 12 of six-bit scales and mins, 128 of nibbles); Q6_K: 210 B / 256.
my_bits = {"Q8_0": 34 * 8 / 32, "Q5_0": 22 * 8 / 32, "Q4_K": 144 * 8 / 256, "Q6_K": 210 * 8 / 256}


# Exercise 2: w = d (q - 8), so sum(w x) = d xs (sum(q xq) - 8 sum(xq)): both sums in integers, the scales once.
def my_q4_0_dot(block, xq, xs):
    d = float(block[:2].view(torch.float16))
    q = torch.cat([block[2:] & 15, block[2:] >> 4]).int()  # (32,): low nibbles are weights 0-15, high ones 16-31
    x = xq.int()  # (32,)
    return d * xs * (int((q * x).sum()) - 8 * int(x.sum()))


# Exercise 3: vpmaddubsw adds each pair of products into an int16, saturating; vpmaddwd by ones adds two of those
# into an int32, which cannot overflow.
def my_avx2_lanes(u, x):
    pairs = (u.long() * x.long()).reshape(16, 2).sum(1).clamp(-32768, 32767)  # (16,) int16, saturated
    return pairs.reshape(8, 2).sum(1)  # (8,)


# Exercise 4: two products of u and 127 must fit 32,767: 2 x 129 x 127 = 32,766, 2 x 130 x 127 = 33,020.
my_largest_safe_u = 129
