"""Lesson 17's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import copy

import pytest
import torch

import hardway
from exercise_solutions import load_solutions
from hardway.formats.gguf import smollm2_gguf
from hardway.exercises.lesson_17 import check_bytes_read, check_int8_row_errors


@pytest.fixture(scope="module")
def solution():
    return load_solutions("17_weight_quantization")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return smollm2_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def model(path):
    return hardway.load(path)


def test_check_bytes_read(solution, model):
    assert check_bytes_read(None, model).startswith("not attempted yet")
    verdict = check_bytes_read(solution.my_bytes_read, model)
    assert verdict.startswith("right") and "int4, groups of 32" in verdict, verdict

    def table_read(m, bits, group):  # the embedding table counted as read, as fp32
        return solution.my_bytes_read(m, bits, group) + m.tok_emb.weight.nbytes

    def head_as_the_table(m, bits, group):  # a tied head read as the fp32 table, not as its quantized copy
        if m.lm_head.weight is not m.tok_emb.weight:
            return solution.my_bytes_read(m, bits, group)
        head = copy.deepcopy(m)
        head.lm_head = torch.nn.Identity()
        return solution.my_bytes_read(head, bits, group) + m.tok_emb.weight.nbytes

    def no_scales(m, bits, group):
        return sum(l.weight.numel() * bits // 8 for l in m.modules() if isinstance(l, torch.nn.Linear)) + \
            sum(p.nbytes for n, p in m.named_parameters() if "norm" in n or n.endswith(".bias"))

    def int4_a_byte_a_weight(m, bits, group):
        return solution.my_bytes_read(m, 8 if bits == 4 else bits, group) + (
            sum(l.weight.shape[0] * l.weight.shape[1] // (group or 32) * 2 for l in m.modules()
                if isinstance(l, torch.nn.Linear)) if bits == 4 else 0)

    def no_norms(m, bits, group):
        return solution.my_bytes_read(m, bits, group) - sum(p.nbytes for n, p in m.named_parameters() if "norm" in n)

    expected_words = {table_read: "the embedding table is stored, not read",
                      head_as_the_table: "the embedding table is stored, not read",
                      int4_a_byte_a_weight: "two int4 weights share a byte",
                      no_norms: "the norms stay fp32"}
    for wrong, words in expected_words.items():
        verdict = check_bytes_read(wrong, model)
        assert verdict.startswith("wrong:") and words in verdict, (wrong.__name__, verdict)
    verdict = check_bytes_read(no_scales, model)
    assert verdict.startswith("wrong:") and "reads" in verdict, verdict


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
