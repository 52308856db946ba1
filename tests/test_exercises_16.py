"""Lesson 16's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import struct

import numpy as np
import pytest

from exercise_solutions import load_solutions
from hardway.formats.gguf import gemma3_gguf, smollm2_gguf
from hardway.formats.hub import models_dir
from hardway.exercises.lesson_16 import check_data_start, check_q4_1_block, check_q4_k_scales, check_tensor_bytes


@pytest.fixture(scope="module")
def solution():
    return load_solutions("16_gguf")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return smollm2_gguf(tmp_path_factory.mktemp("gguf"))


def test_check_q4_1_block(solution, path):
    assert check_q4_1_block(None, path).startswith("not attempted yet")
    assert check_q4_1_block(solution.my_dequantize_q4_1_block, path).startswith("right")

    def interleaved(block):  # (low, high) of byte 0, then of byte 1: the other nibble order
        d, m = struct.unpack("<ee", block[:4])
        q = [n for b in block[4:] for n in (b & 0x0F, b >> 4)]
        return [float(np.float32(d) * np.float32(v) + np.float32(m)) for v in q]

    def no_minimum(block):  # Q4_0's formula on a Q4_1 block
        d, _ = struct.unpack("<ee", block[:4])
        q = [b & 0x0F for b in block[4:]] + [b >> 4 for b in block[4:]]
        return [float(np.float32(d) * np.float32(v - 8)) for v in q]

    def swapped_scale_and_minimum(block):
        m, d = struct.unpack("<ee", block[:4])
        q = [b & 0x0F for b in block[4:]] + [b >> 4 for b in block[4:]]
        return [float(np.float32(d) * np.float32(v) + np.float32(m)) for v in q]

    for wrong in (interleaved, no_minimum, swapped_scale_and_minimum):
        verdict = check_q4_1_block(wrong, path)
        assert verdict.startswith("wrong:") and "nibbles" in verdict, (wrong.__name__, verdict)


def test_check_tensor_bytes(solution, path):
    assert check_tensor_bytes(None, path).startswith("not attempted yet")
    assert check_tensor_bytes(solution.my_tensor_bytes, path).startswith("right")

    def no_block_overhead(type_name, dims):  # 4 bits a weight, forgetting the scales
        bits = {"F32": 32, "F16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4}[type_name]
        return int(np.prod(dims)) * bits // 8

    def q4_1_as_q4_0(type_name, dims):  # forgets Q4_1's minimum
        return solution.my_tensor_bytes("Q4_0" if type_name == "Q4_1" else type_name, dims)

    def last_dim_only(type_name, dims):
        return solution.my_tensor_bytes(type_name, dims[:1])

    for wrong in (no_block_overhead, q4_1_as_q4_0, last_dim_only):
        assert check_tensor_bytes(wrong, path).startswith("wrong:"), wrong.__name__


def test_check_data_start(solution, path):
    assert check_data_start(None, path).startswith("not attempted yet")
    assert check_data_start(solution.my_data_start, path).startswith("right")

    def no_padding(p):  # the end of the tensor infos
        return solution.walk_to_the_data(p)[0]

    def always_32(p):  # ignores general.alignment
        return -(-solution.walk_to_the_data(p)[0] // 32) * 32

    assert check_data_start(no_padding, path).startswith("wrong:")
    verdict = check_data_start(always_32, path)
    assert verdict.startswith("wrong: aligned.gguf"), verdict
    assert check_data_start(lambda p: solution.my_data_start(p) - 8, path).startswith("wrong:")


def test_check_q4_k_scales(solution):
    path = gemma3_gguf(models_dir() / "gguf")
    assert check_q4_k_scales(None, path).startswith("not attempted yet")
    assert check_q4_k_scales(solution.my_unpack_scales_mins, path).startswith("right")

    def nibbles_swapped(packed):  # sub-blocks 4-7: the scale from byte 8+j's high nibble, the min from its low one
        scales, mins = solution.my_unpack_scales_mins(packed)
        for j in range(4):
            scales[4 + j] = (packed[8 + j] >> 4) | ((packed[j] >> 6) << 4)
            mins[4 + j] = (packed[8 + j] & 15) | ((packed[4 + j] >> 6) << 4)
        return scales, mins

    def low_and_high_bits_swapped(packed):  # sub-blocks 4-7: byte 8+j's nibble as the top bits, bits 6-7 as the low
        scales, mins = solution.my_unpack_scales_mins(packed)
        for j in range(4):
            scales[4 + j] = ((packed[8 + j] & 15) << 2) | (packed[j] >> 6)
            mins[4 + j] = ((packed[8 + j] >> 4) << 2) | (packed[4 + j] >> 6)
        return scales, mins

    def no_top_bits(packed):  # sub-blocks 4-7 from byte 8+j alone: their top 2 bits forgotten
        scales, mins = solution.my_unpack_scales_mins(packed)
        for j in range(4):
            scales[4 + j], mins[4 + j] = packed[8 + j] & 15, packed[8 + j] >> 4
        return scales, mins

    def eight_bits(packed):  # sub-blocks 0-3 with the top 2 bits of their bytes left on
        scales, mins = solution.my_unpack_scales_mins(packed)
        return [packed[j] for j in range(4)] + scales[4:], [packed[4 + j] for j in range(4)] + mins[4:]

    def mins_first(packed):
        scales, mins = solution.my_unpack_scales_mins(packed)
        return mins, scales

    for wrong in (nibbles_swapped, low_and_high_bits_swapped, no_top_bits):
        verdict = check_q4_k_scales(wrong, path)
        assert verdict.startswith("wrong:") and "sub-block " in verdict and "top 2 bits" in verdict, (wrong.__name__, verdict)
        assert any(f"sub-block {j}'s" in verdict for j in range(4, 8)), verdict  # it names the sub-block that differs
    for wrong in (eight_bits, mins_first):
        verdict = check_q4_k_scales(wrong, path)
        assert verdict.startswith("wrong:") and "sub-block " in verdict, (wrong.__name__, verdict)
