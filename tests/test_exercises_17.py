"""Lesson 17's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.formats.gguf import smollm2_gguf
from hardway.exercises.lesson_17 import check_int4_bytes, check_int8_row


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


def test_check_int8_row(solution, path):
    assert check_int8_row(None, path).startswith("not attempted yet")
    assert check_int8_row(solution.my_quantize_int8_row, path).startswith("right")

    def over_128(row):
        scale = row.abs().max().item() / 128
        return (torch.round(row / scale) if scale else torch.zeros_like(row)), scale

    def largest_positive(row):  # max, not max |w|: a row whose largest |w| is negative overflows
        scale = row.max().item() / 127
        return (torch.round(row / scale).clamp(-127, 127) if scale > 0 else torch.zeros_like(row)), scale

    def truncated(row):
        scale = row.abs().max().item() / 127
        return (torch.trunc(row / scale) if scale else torch.zeros_like(row)), scale

    def unrounded(row):
        scale = row.abs().max().item() / 127
        return (row / scale if scale else torch.zeros_like(row)), scale

    def nan_for_zeros(row):  # divides a row of zeros by a scale of 0
        scale = row.abs().max().item() / 127
        return torch.round(row / scale) if scale else torch.full_like(row, float("nan")), scale

    expected = {over_128: "127", largest_positive: "either sign", truncated: "do not truncate",
                unrounded: "whole number", nan_for_zeros: "zeros"}
    for wrong, words in expected.items():
        verdict = check_int8_row(wrong, path)
        assert verdict.startswith("wrong:") and words in verdict, (wrong.__name__, verdict)
