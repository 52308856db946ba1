"""Lesson 16's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import struct

import numpy as np
import pytest

from exercise_solutions import load_solutions
from hardway.formats.gguf import gemma3_gguf, smollm2_gguf
from hardway.formats.hub import models_dir
from hardway.exercises.lesson_16 import (check_data_bytes, check_diagnosis, check_q6_k_weights, check_tensor_bytes,
                                         planted_q4_1_dequantizers)


@pytest.fixture(scope="module")
def solution():
    return load_solutions("16_gguf")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return smollm2_gguf(tmp_path_factory.mktemp("gguf"))


def test_check_diagnosis(solution):
    assert check_diagnosis(None).startswith("not attempted yet")
    assert check_diagnosis(solution.my_diagnosis).startswith("right")
    wrong_answers = [
        {"a": "minimum added before scaling", "b": "nibble order"},  # the two right names, on the wrong suspects
        {"a": "high nibbles first", "b": "minimum added before scaling"},  # a is a permutation too, but weight 0 is right
        {"a": "nibble order", "b": "scale and minimum swapped"},  # b's values are all wrong too, but by a constant
        {"a": "nibble order", "b": "Q4_0's formula"},  # also a constant per block, m + 8 d, not (d - 1) m
        {"a": "nibbles", "b": "minimum added before scaling"},  # not a key of BUGS
        {"a": "nibble order"},  # one suspect left out
    ]
    for answer in wrong_answers:
        assert check_diagnosis(answer).startswith("wrong:"), answer


def test_the_planted_bugs_are_what_the_check_says(path):
    """The suspects really have the bugs the check names: a's values are gguf's permuted with weight 0 in place,
    b's are off by (d - 1) * m in every weight."""
    from hardway.formats.gguf import read_gguf
    import gguf
    import gguf.quants
    import torch

    suspect_a, suspect_b = planted_q4_1_dequantizers()
    raw = read_gguf(path).raw("blk.0.attn_q.weight")[: 20 * 64]  # 64 blocks
    expected = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_1).copy())
    expected = expected.reshape(64, 32)
    a, b = suspect_a(raw).reshape(64, 32), suspect_b(raw).reshape(64, 32)
    assert torch.equal(a.sort(dim=1).values, expected.sort(dim=1).values) and torch.equal(a[:, 0], expected[:, 0])
    assert not torch.equal(a, expected)
    blocks = raw.reshape(64, 20)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    assert torch.allclose(b - expected, (d - 1) * m, atol=1e-6)


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


def test_check_data_bytes(solution, path):
    gemma_path = gemma3_gguf(models_dir() / "gguf")
    assert check_data_bytes(None, path, gemma_path).startswith("not attempted yet")
    verdict = check_data_bytes(solution.my_data_bytes, path, gemma_path)
    assert verdict.startswith("right") and "bits a weight" in verdict, verdict

    def no_padding(tensors, alignment):  # the sizes summed: tensors packed end to end
        return sum(solution.my_tensor_bytes(t, d) if t in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
                   else solution.my_data_bytes([(t, d)], alignment) for t, d in tensors)

    def padded_end(tensors, alignment):  # the last tensor padded too: the gguf package's writer does, llama.cpp not
        return -(-solution.my_data_bytes(tensors, alignment) // alignment) * alignment

    def k_quants_without_scales(tensors, alignment):  # Q4_K as 4 bits, Q6_K as 6: the super-block's scales forgotten
        bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q5_0": 5}
        sizes = [(t, d) if t not in bits else ("F32", [int(np.prod(d)) * bits[t] // 32]) for t, d in tensors]
        return solution.my_data_bytes(sizes, alignment)

    def always_32(tensors, alignment):  # general.alignment ignored
        return solution.my_data_bytes(tensors, 32)

    for wrong in (no_padding, padded_end, k_quants_without_scales, always_32):
        assert check_data_bytes(wrong, path, gemma_path).startswith("wrong:"), wrong.__name__


def test_check_q6_k_weights(solution):
    path = gemma3_gguf(models_dir() / "gguf")
    assert check_q6_k_weights(None, path).startswith("not attempted yet")
    assert check_q6_k_weights(solution.my_q6_k_weights, path).startswith("right")

    def weights(block, low_at, high_at, scale_of=lambda i, s: s[i // 16], offset=32, d_at=208):
        """A Q6_K reader whose every part can be moved: low_at(h, r) -> (byte, shift), high_at(h, r) -> (byte,
        shift), scale_of(i, scales), d at bytes d_at, d_at + 1."""
        scales = struct.unpack("<16b", block[192:208])
        (d,) = struct.unpack("<e", block[d_at:d_at + 2])
        out = []
        for i in range(256):
            h, r = divmod(i, 128)
            (lb, ls), (hb, hs) = low_at(h, r), high_at(h, r)
            q = ((block[lb] >> ls) & 15) | (((block[128 + hb] >> hs) & 3) << 4)
            out.append(float(np.float32(np.float32(d) * np.float32(scale_of(i, scales))) * np.float32(q - offset)))
        return out

    def right_low(h, r):
        return 64 * h + r % 64, 0 if r < 64 else 4

    def right_high(h, r):
        return 32 * h + r % 32, 2 * (r // 32)

    def q4_k_nibbles(block):  # Q4_K's runs of 32 bytes (low nibbles, then high) for the low bits
        return weights(block, lambda h, r: (64 * h + 32 * (r // 64) + r % 32, 4 * ((r // 32) % 2)), right_high)

    def neighbours_share_a_byte(block):  # weights 2k and 2k+1 in one byte's low and high nibble
        return weights(block, lambda h, r: (64 * h + r // 2, 4 * (r % 2)), right_high)

    def high_bits_in_fours(block):  # four neighbouring weights' high bits in one byte
        return weights(block, right_low, lambda h, r: (32 * h + r // 4, 2 * (r % 4)))

    def unsigned_scales(block):
        return weights(block, right_low, right_high, scale_of=lambda i, s: s[i // 16] % 256)

    def a_scale_per_32(block):  # Q4_K's sub-blocks of 32
        return weights(block, right_low, right_high, scale_of=lambda i, s: s[i // 32])

    def no_offset(block):
        return weights(block, right_low, right_high, offset=0)

    def d_first(block):  # d where Q4_K keeps it, bytes 0-1
        return weights(block, right_low, right_high, d_at=0)

    expected_words = {q4_k_nibbles: "low 4 bits", neighbours_share_a_byte: "low 4 bits",
                      high_bits_in_fours: "high 2 bits", unsigned_scales: "signed", a_scale_per_32: "one scale per 16",
                      no_offset: "offset by 32", d_first: "the last two bytes"}
    for wrong, words in expected_words.items():
        verdict = check_q6_k_weights(wrong, path)
        assert verdict.startswith("wrong:") and words in verdict, (wrong.__name__, verdict)
