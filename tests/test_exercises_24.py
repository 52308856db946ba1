"""Lesson 24's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import pytest

from exercise_solutions import load_solutions
from hardway.exercises.lesson_24 import (BUGS, PLANTED, check_diagnosis, check_int8_error_bound, check_kv_cache_bytes,
                                         planted_kernels)


@pytest.fixture(scope="module")
def solution():
    return load_solutions("24_long_context_memory")


def test_check_diagnosis(solution):
    assert check_diagnosis(None).startswith("not attempted yet")
    verdict = check_diagnosis(solution.my_diagnosis)
    assert verdict.startswith("right"), verdict
    assert solution.my_diagnosis == PLANTED  # the solution finds them by running the kernels, not by reading PLANTED
    assert set(planted_kernels()) == set(PLANTED)
    # two swapped: the rescaling bug and the offset bug both hide in a single key tile at start 0
    swapped = dict(PLANTED, A=PLANTED["B"], B=PLANTED["A"])
    assert check_diagnosis(swapped).startswith("wrong")
    # the same bug named for every suspect: each one is "wrong somewhere in the softmax"
    assert check_diagnosis({name: BUGS[0] for name in PLANTED}).startswith("wrong")
    assert check_diagnosis({"A": "the mask", "B": BUGS[0], "C": BUGS[1]}).startswith("wrong")  # not one of BUGS


def test_check_kv_cache_bytes(solution):
    assert check_kv_cache_bytes(None).startswith("not attempted yet")
    verdict = check_kv_cache_bytes(solution.my_kv_cache_bytes)
    assert verdict.startswith("right"), verdict

    def keys_only(n_layers, n_kv_heads, head_dim, n_positions, kv_cache_dtype, dtype):  # forgets the values
        return solution.my_kv_cache_bytes(n_layers, n_kv_heads, head_dim, n_positions, kv_cache_dtype, dtype) // 2

    def no_scales(n_layers, n_kv_heads, head_dim, n_positions, kv_cache_dtype, dtype):  # int8 = 1 byte, nothing else
        per = head_dim if kv_cache_dtype == "int8" else head_dim * dtype.itemsize
        return 2 * n_layers * n_kv_heads * n_positions * per

    def always_fp32(n_layers, n_kv_heads, head_dim, n_positions, kv_cache_dtype, dtype):  # ignores the model's bf16
        per = head_dim + 4 if kv_cache_dtype == "int8" else head_dim * 4
        return 2 * n_layers * n_kv_heads * n_positions * per

    for wrong in (keys_only, no_scales, always_fp32):
        assert check_kv_cache_bytes(wrong).startswith("wrong"), wrong.__name__
    assert "a key AND a value" in check_kv_cache_bytes(keys_only)


def test_check_int8_error_bound(solution):
    assert check_int8_error_bound(None).startswith("not attempted yet")
    verdict = check_int8_error_bound(solution.my_error_bound)
    assert verdict.startswith("right"), verdict
    whole_step = lambda rows: rows.abs().amax(dim=-1, keepdim=True) / 127  # sound, but a whole step: twice too loose
    mean_based = lambda rows: rows.abs().mean(dim=-1, keepdim=True) / 254  # the typical value, not the largest
    just_under = lambda rows: rows.abs().amax(dim=-1, keepdim=True) / 256  # a power of two, a hair too tight
    assert "looser" in check_int8_error_bound(whole_step)
    assert check_int8_error_bound(mean_based).startswith("wrong")
    assert check_int8_error_bound(just_under).startswith("wrong")
    assert check_int8_error_bound(lambda rows: rows.abs().amax() / 254).startswith("wrong")  # one number, not (n, 1)
