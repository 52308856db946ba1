"""Lesson 26's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_26 import check_avx2_lanes, check_bits_per_weight, check_largest_safe_u, check_q4_0_dot


@pytest.fixture(scope="module")
def sol():
    return load_solutions("26_integer_kernels")


def test_check_bits_per_weight(sol):
    assert check_bits_per_weight(None).startswith("not attempted yet")
    assert check_bits_per_weight(sol.my_bits).startswith("right")
    # Plausible: the weights' own bits, as the type's name suggests.
    result = check_bits_per_weight({"Q8_0": 8, "Q5_0": 5, "Q4_K": 4, "Q6_K": 6})
    assert result.startswith("wrong") and "scales" in result
    # Plausible: Q4_K with d and dmin but without the runs' six-bit scales.
    result = check_bits_per_weight({**sol.my_bits, "Q4_K": 132 * 8 / 256})
    assert result.startswith("wrong") and "12 bytes" in result
    # Plausible: a type left out.
    assert check_bits_per_weight({"Q8_0": 8.5}).startswith("wrong")


def test_check_q4_0_dot(sol):
    assert check_q4_0_dot(None).startswith("not attempted yet")
    assert check_q4_0_dot(sol.my_q4_0_dot).startswith("right")

    def no_offset(block, xq, xs):  # plausible: the nibbles taken as the weights' values
        d = float(block[:2].view(torch.float16))
        q = torch.cat([block[2:] & 15, block[2:] >> 4]).int()
        return d * xs * int((q * xq.int()).sum())

    def interleaved(block, xq, xs):  # plausible: byte j holding weights 2j and 2j + 1
        d = float(block[:2].view(torch.float16))
        q = torch.stack([block[2:] & 15, block[2:] >> 4], dim=1).reshape(32).int() - 8
        return d * xs * int((q * xq.int()).sum())

    def scale_forgotten(block, xq, xs):  # plausible: the activations' scale left out
        return sol.my_q4_0_dot(block, xq, 1.0)

    result = check_q4_0_dot(no_offset)
    assert result.startswith("wrong") and "q - 8" in result
    result = check_q4_0_dot(interleaved)
    assert result.startswith("wrong") and "weights 0-15" in result
    assert check_q4_0_dot(scale_forgotten).startswith("wrong")

    def raises(block, xq, xs):
        raise NotImplementedError

    assert check_q4_0_dot(raises).startswith("not attempted yet")


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
