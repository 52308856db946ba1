"""Lesson 26's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import math

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_26 import check_avx2_lanes, check_largest_safe_u, check_q4_k_dot, check_token_time
from hardway.formats.gguf_quants import TENSOR_TYPES


@pytest.fixture(scope="module")
def sol():
    return load_solutions("26_integer_kernels")


def test_check_token_time(sol):
    bandwidth = 20e9
    assert check_token_time(None).startswith("not attempted yet")
    assert check_token_time(sol.my_token_ms, bandwidth).startswith("right")

    def bytes_of(tensors, table="as read", nominal=False, k_per=None):  # written here from the layouts, as a learner
        layouts = {name: (per, nbytes) for name, per, nbytes in TENSOR_TYPES.values()}
        own_bits = {"Q4_0": 4, "Q8_0": 8, "Q4_K": 4, "Q6_K": 6, "F32": 32}
        total = 0.0
        for name, (type_name, shape) in tensors.items():
            per, nbytes = layouts[type_name]
            n = math.prod(shape)
            size = n * own_bits[type_name] / 8 if nominal else n / (k_per if k_per and per == 256 else per) * nbytes
            one_row = table == "one row" or (table == "as read" and "output.weight" in tensors)
            total += size / shape[0] if name == "token_embd.weight" and one_row else size
        return total

    wrongs = {  # plausible mistakes -> what the check must say
        "the token table is read in full, but only where it is also the head":
            lambda t, bw: bytes_of(t, "in full") / bw * 1e3,
        "the head reads all of it": lambda t, bw: bytes_of(t, "one row") / bw * 1e3,
        "with its scales": lambda t, bw: bytes_of(t, nominal=True) / bw * 1e3,
        "256 weights, not 32": lambda t, bw: bytes_of(t, k_per=32) / bw * 1e3,
        "8 bits a byte": lambda t, bw: 8 * bytes_of(t) / bw * 1e3,
        "not seconds": lambda t, bw: bytes_of(t) / bw,
    }
    for words, wrong in wrongs.items():
        verdict = check_token_time(wrong, bandwidth)
        assert verdict.startswith("wrong:") and words in verdict, (words, verdict)
    # the norms and one row of the table are within the tolerance: a learner who leaves them out is right
    no_norms = lambda t, bw: sol.my_token_ms({k: v for k, v in t.items() if len(v[1]) == 2}, bw)  # noqa: E731
    assert check_token_time(no_norms, bandwidth).startswith("right")
    # with the lesson's file and its measured speed, the share of a token spent reading weights
    own = {"token_embd.weight": ("Q8_0", (262144, 640)), "blk.0.ffn_up.weight": ("Q5_0", (2048, 640))}
    ms = sol.my_token_ms(own, bandwidth)
    verdict = check_token_time(sol.my_token_ms, bandwidth, own, 250 / ms)
    assert verdict.startswith("right") and "25% of a token" in verdict and "around the matrices" in verdict, verdict


def test_check_q4_k_dot(sol):
    assert check_q4_k_dot(None).startswith("not attempted yet")
    assert check_q4_k_dot(sol.my_q4_k_dot).startswith("right")

    def parts(u, sc, mn, xq):  # (8, 32) each: the runs
        return u.long().reshape(8, 32), sc.long(), mn.long(), xq.long().reshape(8, 32)

    def no_mins(u, sc, mn, d, dmin, xq, xs):  # plausible: Q4_0's habit, no minimum
        u, sc, mn, x = parts(u, sc, mn, xq)
        return d * xs * int((sc * (u * x).sum(1)).sum())

    def one_sum(u, sc, mn, d, dmin, xq, xs):  # plausible: the minimums' term with one sum of x for the block
        u, sc, mn, x = parts(u, sc, mn, xq)
        return d * xs * int((sc * (u * x).sum(1)).sum()) - dmin * xs * float(mn.double().mean()) * int(x.sum())

    def plus_min(u, sc, mn, d, dmin, xq, xs):  # plausible: Q4_1's sign
        u, sc, mn, x = parts(u, sc, mn, xq)
        return d * xs * int((sc * (u * x).sum(1)).sum()) + dmin * xs * int((mn * x.sum(1)).sum())

    def swapped(u, sc, mn, d, dmin, xq, xs):  # plausible: the scales and the minimums the other way round
        return sol.my_q4_k_dot(u, mn, sc, d, dmin, xq, xs)

    def no_xs(u, sc, mn, d, dmin, xq, xs):  # plausible: the activations' scale left out
        return sol.my_q4_k_dot(u, sc, mn, d, dmin, xq, 1.0)

    def dequantized(u, sc, mn, d, dmin, xq, xs):  # right another way: floats, weight by weight, in fp32
        j = torch.arange(256) // 32
        w = d * sc[j].float() * u.float() - dmin * mn[j].float()
        return float(w @ (xq.float() * xs))

    for wrong, words in [(no_mins, "minimums are missing"), (one_sum, "each run of 32"), (plus_min, "subtracts"),
                         (swapped, "swapped"), (no_xs, "multiplies both sums")]:
        verdict = check_q4_k_dot(wrong)
        assert verdict.startswith("wrong") and words in verdict, (wrong.__name__, verdict)
    assert check_q4_k_dot(dequantized).startswith("right")
    assert check_q4_k_dot(lambda *args: "a float").startswith("wrong: case 0: expected a float")


def test_check_avx2_lanes(sol):
    assert check_avx2_lanes(None).startswith("not attempted yet")
    assert check_avx2_lanes(sol.my_avx2_lanes).startswith("right")

    def exact(u, x):  # plausible: the sums of four products, as vpdpbusd gives them
        return (u.long() * x.long()).reshape(8, 4).sum(1)

    def clamped_fours(u, x):  # plausible: the saturation put on the sum of four
        return exact(u, x).clamp(-32768, 32767)

    def interleaved(u, x):  # plausible: lane l taking products l, l + 8, l + 16, l + 24
        return (u.long() * x.long()).reshape(4, 8).sum(0)

    result = check_avx2_lanes(exact)
    assert result.startswith("wrong") and "int16" in result and "64,770" in result
    result = check_avx2_lanes(clamped_fours)
    assert result.startswith("wrong") and "pair of products" in result
    result = check_avx2_lanes(interleaved)
    assert result.startswith("wrong") and "products 4l to 4l + 3" in result
    assert check_avx2_lanes(lambda u, x: exact(u, x)[:4]).startswith("wrong: case 0: expected 8 lanes")


def test_check_largest_safe_u(sol):
    assert check_largest_safe_u(None).startswith("not attempted yet")
    assert check_largest_safe_u(sol.my_largest_safe_u).startswith("right")
    assert "unsigned" in check_largest_safe_u(127)  # plausible: a signed byte's largest
    assert "unpacked" in check_largest_safe_u(63)  # plausible: what the weights reach
    assert "32,766" not in check_largest_safe_u(255) and check_largest_safe_u(255).startswith("wrong")
    assert check_largest_safe_u(128).startswith("wrong") and "a larger u is safe" in check_largest_safe_u(128)
    assert "more than an int16 holds" in check_largest_safe_u(130)
    assert check_largest_safe_u(129.0).startswith("wrong: expected an integer")
