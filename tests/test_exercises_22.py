"""Lesson 22's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers. The C ones build small sources with compile_c (cached) and skip without a compiler."""

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_22 import BUGS, check_diagnosis, check_int4_loop, check_predict_time, planted_loops
from hardway.kernels.c_loops import c_loops_available
from hardway.kernels.quantized import matvec_int8

needs_c = pytest.mark.skipif(not c_loops_available(), reason="no C compiler")


@pytest.fixture(scope="module")
def solution():
    return load_solutions("22_engine_room")


def test_check_predict_time(solution):
    bandwidth = 10e9  # bytes/s: the formula is checked against it; the timing is only printed
    assert check_predict_time(None, bandwidth).startswith("not attempted yet")
    verdict = check_predict_time(solution.my_predicted_us, bandwidth)
    assert verdict.startswith("right"), verdict
    # the timing runs on any matrix-vector product given (the notebook gives its C loop): lesson 17's torch loop here
    verdict = check_predict_time(solution.my_predicted_us, bandwidth, lambda x, q, s: matvec_int8(x, q, s[:, None]))
    assert verdict.startswith("right") and "measured" in verdict, verdict

    def matrix_only(out_features, in_features, bandwidth):  # the matrix alone: x, y and scales are under 1% here
        return out_features * in_features / bandwidth * 1e6

    assert check_predict_time(matrix_only, bandwidth).startswith("right")

    def fp32_bytes(out_features, in_features, bandwidth):  # thinks of the dequantized matrix
        return 4 * out_features * in_features / bandwidth * 1e6

    def bits(out_features, in_features, bandwidth):  # counts bits, not bytes
        return 8 * out_features * in_features / bandwidth * 1e6

    def seconds(out_features, in_features, bandwidth):  # the right time, in seconds instead of microseconds
        return out_features * in_features / bandwidth

    def flops(out_features, in_features, bandwidth):  # two operations a weight, divided by the bandwidth
        return 2 * out_features * in_features / bandwidth * 1e6

    expected = {fp32_bytes: "fp32", bits: "8 bits", seconds: "microseconds", flops: "count the bytes"}
    for wrong, words in expected.items():
        verdict = check_predict_time(wrong, bandwidth)
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
