"""Lesson 22's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers. The C ones build small sources with compile_c (cached) and skip without a compiler."""

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_22 import (BUGS, SMALL_SHAPE, check_diagnosis, check_int4_loop, check_predict_time,
                                         planted_loops)
from hardway.kernels.c_loops import c_loops_available

needs_c = pytest.mark.skipif(not c_loops_available(), reason="no C compiler")


@pytest.fixture(scope="module")
def solution():
    return load_solutions("22_engine_room")


def test_check_predict_time(solution):
    bandwidth = 10e9  # bytes/s: the formula is checked against it
    assert check_predict_time(None, None, bandwidth).startswith("not attempted yet")
    verdict = check_predict_time(solution.my_predicted_us, None, bandwidth)
    assert verdict.startswith("right") and "now set my_small_matrix" in verdict, verdict
    floor = solution.my_predicted_us(*SMALL_SHAPE, bandwidth)
    # the prediction about the small matrix is tested against the measurement given, both ways
    for measured, outcome in ((0.5 * floor, "faster"), (3 * floor, "slower")):
        verdict = check_predict_time(solution.my_predicted_us, outcome, bandwidth, measured)
        assert verdict.startswith("right") and f"{outcome} as you predicted" in verdict, verdict
        other = "slower" if outcome == "faster" else "faster"
        verdict = check_predict_time(solution.my_predicted_us, other, bandwidth, measured)
        assert verdict.startswith("wrong:") and f"you predicted {other}" in verdict, verdict
    assert "cache" in check_predict_time(solution.my_predicted_us, "slower", bandwidth, 0.5 * floor)
    assert "call from Python" in check_predict_time(solution.my_predicted_us, "faster", bandwidth, 3 * floor)
    assert "nothing was measured" in check_predict_time(solution.my_predicted_us, "faster", bandwidth, None)
    assert check_predict_time(solution.my_predicted_us, "quicker", bandwidth, floor).startswith("wrong:")

    def matrix_only(out_features, in_features, bandwidth):  # the matrix alone: right on large ones, not on skinny
        return out_features * in_features / bandwidth * 1e6

    def no_scales(out_features, in_features, bandwidth):  # y and x counted, the scales forgotten
        return (out_features * in_features + 4 * out_features + 4 * in_features) / bandwidth * 1e6

    def no_x(out_features, in_features, bandwidth):  # the scales and y counted, x forgotten
        return (out_features * in_features + 8 * out_features) / bandwidth * 1e6

    def fp32_bytes(out_features, in_features, bandwidth):  # thinks of the dequantized matrix
        return (4 * out_features * in_features + 8 * out_features + 4 * in_features) / bandwidth * 1e6

    def bits(out_features, in_features, bandwidth):  # counts bits, not bytes
        return 8 * solution.my_predicted_us(out_features, in_features, bandwidth)

    def seconds(out_features, in_features, bandwidth):  # the right time, in seconds instead of microseconds
        return solution.my_predicted_us(out_features, in_features, bandwidth) / 1e6

    def flops(out_features, in_features, bandwidth):  # two operations a weight, divided by the bandwidth
        return 2 * out_features * in_features / bandwidth * 1e6

    expected = {matrix_only: "only the matrix", no_scales: "4 bytes a row are missing", no_x: "x is missing",
                fp32_bytes: "fp32", bits: "8 bits", seconds: "microseconds", flops: "two operations"}
    for wrong, words in expected.items():
        verdict = check_predict_time(wrong, "faster", bandwidth, floor / 2)
        assert verdict.startswith("wrong:") and words in verdict, (wrong.__name__, verdict)


@needs_c
def test_planted_loops_are_what_the_check_says():
    """The plants behave as the solution's probes say, so the diagnosis is findable by running them."""
    loops = planted_loops()
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (67, 40), dtype=torch.int8)  # 67 rows: 3 left over after blocks of four
    scale, x = torch.rand(67) + 0.5, torch.randn(40)
    reference = (q.float() @ x) * scale
    wrong_rows = ((loops["A"](x, q, scale) - reference).abs() > 1e-3).nonzero().flatten().tolist()
    assert wrong_rows and set(wrong_rows) <= {64, 65, 66}
    last = torch.zeros(40)
    last[-1] = 1.0
    assert torch.equal(loops["C"](last, q, scale), torch.zeros(67))
    same = torch.full((67,), 0.7)
    assert torch.allclose(loops["B"](x, q, same), (q.float() @ x) * same, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(loops["B"](x, q, scale), reference, rtol=1e-3, atol=1e-2)


@needs_c
def test_check_diagnosis(solution):
    assert check_diagnosis(None).startswith("not attempted yet")
    assert check_diagnosis(solution.my_diagnosis).startswith("right")
    swapped = {**solution.my_diagnosis, "A": BUGS[0], "B": BUGS[1]}  # the two bugs that hide on some inputs
    decoy = {**solution.my_diagnosis, "C": "x read one place late"}  # both give small errors everywhere
    for wrong, words in [(swapped, "loop A is not"), (decoy, "loop C is not"),
                         ({"A": BUGS[1], "B": BUGS[0]}, "no diagnosis for loop C"),
                         ({**solution.my_diagnosis, "A": "off by one"}, "none of BUGS"), ("A, B, C", "give a dict")]:
        verdict = check_diagnosis(wrong)
        assert verdict.startswith("wrong:") and words in verdict, (wrong, verdict)


@needs_c
def test_check_int4_loop(solution):
    assert check_int4_loop(None).startswith("not attempted yet")
    verdict = check_int4_loop(solution.my_int4_source)
    assert verdict.startswith("right"), verdict
    source = solution.my_int4_source
    adjacent = source.replace("xg[j] + (float)(b[j] >> 4) * xg[j + half]",
                              "xg[2 * j] + (float)(b[j] >> 4) * xg[2 * j + 1]")
    swapped = source.replace("(float)(b[j] & 15) * xg[j] + (float)(b[j] >> 4) * xg[j + half]",
                             "(float)(b[j] >> 4) * xg[j] + (float)(b[j] & 15) * xg[j + half]")
    no_minimum = source.replace(" + m[r * groups + g] * sum", "")
    signed = source.replace("(float)(b[j] & 15)", "(float)((b[j] & 15) - 8)").replace(
        "(float)(b[j] >> 4)", "(float)((b[j] >> 4) - 8)")
    typo = source.replace("float acc = 0;", "float acc = 0")
    # adjacent: most formats pack neighbours; swapped: the high nibble read as the first half; no minimum: Q4_0's
    # arithmetic (a scale only); signed: nibbles as -8..7, as Q4_0 stores them; typo: the compiler's message shown
    for wrong, words in [(adjacent, "adjacent"), (swapped, "swapped"), (no_minimum, "minimum is missing"),
                         (signed, "unsigned"), (typo, "does not compile"), (b"bytes", "as a string")]:
        assert wrong != source or isinstance(wrong, bytes)
        verdict = check_int4_loop(wrong)
        assert verdict.startswith("wrong:") and words in verdict, (words, verdict)


def test_checks_skip_without_a_compiler(solution, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    assert check_int4_loop(solution.my_int4_source).startswith("skipped: no C compiler")
