"""Lesson 17's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.formats.gguf import smollm2_gguf
from hardway.exercises.lesson_17 import check_int4_bytes, check_int8_row_errors


@pytest.fixture(scope="module")
def solution():
    return load_solutions("17_weight_quantization")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return smollm2_gguf(tmp_path_factory.mktemp("gguf"))


def test_check_int4_bytes(solution):
    assert check_int4_bytes(None).startswith("not attempted yet")
    verdict = check_int4_bytes(solution.my_int4_bytes)
    assert verdict.startswith("right") and "group 32: 5.00 bits a weight" in verdict, verdict

    def no_minimums(out_features, in_features, group_size):  # Q4_0's bytes: a scale, no minimum
        return out_features * in_features // 2 + out_features * (in_features // group_size) * 2

    def fp32_scales(out_features, in_features, group_size):
        return out_features * in_features // 2 + out_features * (in_features // group_size) * 8

    def one_scale_per_row(out_features, in_features, group_size):
        return out_features * in_features // 2 + out_features * 4

    def a_byte_a_weight(out_features, in_features, group_size):
        return out_features * in_features + out_features * (in_features // group_size) * 4

    for wrong in (no_minimums, fp32_scales, one_scale_per_row, a_byte_a_weight):
        verdict = check_int4_bytes(wrong)
        assert verdict.startswith("wrong:") and "half a byte a weight" in verdict, (wrong.__name__, verdict)


def test_check_int8_row_errors(solution, path):
    assert check_int8_row_errors(None, path).startswith("not attempted yet")
    verdict = check_int8_row_errors(solution.my_int8_row_error, path)
    assert verdict.startswith("right") and "worst row" in verdict, verdict

    def largest_error(w):  # half a step, the worst a single weight can be off: the RMS is step / sqrt(12)
        return w.abs().amax(dim=1) / 127 / 2 / w.pow(2).mean(dim=1).sqrt()

    def absolute(w):  # the error's RMS, not relative to the row
        return w.abs().amax(dim=1) / 127 / 12 ** 0.5

    def same_for_every_row(w):  # relative to the largest |w| instead of the row's RMS: the outliers cancel out
        return torch.full((w.shape[0],), 1 / 127 / 12 ** 0.5)

    def levels_256(w):  # the step as if int8 had 256 levels over the largest |w|
        return w.abs().amax(dim=1) / 255 / 12 ** 0.5 / w.pow(2).mean(dim=1).sqrt()

    for wrong in (largest_error, absolute, same_for_every_row, levels_256):
        verdict = check_int8_row_errors(wrong, path)
        assert verdict.startswith("wrong:"), (wrong.__name__, verdict)
    assert check_int8_row_errors(lambda w: solution.my_int8_row_error(w)[:-1], path).startswith("wrong:")
