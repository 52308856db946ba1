"""Reference solutions to lesson 26's exercises (notebooks/26_integer_kernels.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import math

from hardway.formats.gguf_quants import TENSOR_TYPES

# Exercise 1: a token reads every tensor once, each as stored (lesson 16's TENSOR_TYPES: bytes a block over weights a
# block, scales included); the token table in full where it is also the head (no output.weight), else one row of it,
# the token's embedding. Milliseconds = bytes / (bytes per second) * 1000.
def my_token_ms(tensors, bandwidth):
    layouts = {name: (per, nbytes) for name, per, nbytes in TENSOR_TYPES.values()}
    total = 0.0
    for name, (type_name, shape) in tensors.items():
        per, nbytes = layouts[type_name]
        rows = shape[0] if name == "token_embd.weight" and "output.weight" in tensors else 1
        total += math.prod(shape) / per * nbytes / rows
    return total / bandwidth * 1e3


# Exercise 2: w = d sc_j u - dmin mn_j in run j, x = xs xq. Per run, two integer sums: u . xq and the sum of xq. The
# scales are integers too, so sum_j sc_j (u . xq)_j and sum_j mn_j (sum xq)_j stay in integers (int32 holds them:
# 8 x 63 x 32 x 15 x 127 is about 31 million), and the floats come in once each: d xs and dmin xs.
def my_q4_k_dot(u, sc, mn, d, dmin, xq, xs):
    u, x = u.long().reshape(8, 32), xq.long().reshape(8, 32)  # (8 runs, 32)
    dots, sums = (u * x).sum(1), x.sum(1)  # (8,) each, integers
    return d * xs * int((sc.long() * dots).sum()) - dmin * xs * int((mn.long() * sums).sum())


# Exercise 3: vpmaddubsw adds each pair of products into an int16, saturating; vpmaddwd by ones adds two of those
# into an int32, which cannot overflow.
def my_avx2_lanes(u, x):
    pairs = (u.long() * x.long()).reshape(16, 2).sum(1).clamp(-32768, 32767)  # (16,) int16, saturated
    return pairs.reshape(8, 2).sum(1)  # (8,)


# Exercise 4: two products of u and 127 must fit 32,767: 2 x 129 x 127 = 32,766, 2 x 130 x 127 = 33,020.
my_largest_safe_u = 129
