"""Lesson 11's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers. On the SmolLM2-135M stand-in, fp32, CPU."""


import pytest
import torch

from hardway.exercises.lesson_11 import check_diagnosis, check_find_broken_layer, check_relative_divergence, rounding_only
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer
from hardway.verify.ritual import DEFAULT_PROMPT, TOLERANCE, first_divergent_layer, hidden_state_diffs, load_reference
from exercise_solutions import load_solutions

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _solutions():
    return load_solutions("11_verification_ritual")


@pytest.fixture(scope="module")
def pair():
    folder = checkpoint(SMOLLM2)
    ids = torch.tensor([load_tokenizer(folder).encode(DEFAULT_PROMPT)])
    return load(folder), load_reference(folder), ids


def test_check_relative_divergence():
    solution = _solutions().my_relative_divergence
    assert check_relative_divergence(None).startswith("not attempted yet")
    assert check_relative_divergence(solution).startswith("right")

    def max_over_max(h, h_ref):  # max |Δ| / max |h_ref| per position: one huge activation hides the rest
        h, h_ref = h.float(), h_ref.float()
        return (h - h_ref).abs().amax(-1) / h_ref.abs().amax(-1)

    def one_number(h, h_ref):  # the whole tensor at once
        return (h.float() - h_ref.float()).norm() / h_ref.float().norm()

    def divides_by_h(h, h_ref):  # measured against the wrong side
        return (h.float() - h_ref.float()).norm(dim=-1) / h.float().norm(dim=-1)

    def in_the_inputs_dtype(h, h_ref):  # no cast: bf16 norms
        return (h - h_ref).norm(dim=-1) / h_ref.norm(dim=-1)

    assert check_relative_divergence(max_over_max).startswith("wrong: on 'h = h_ref + small noise'")
    assert "shape (2, 5)" in check_relative_divergence(one_number)
    assert check_relative_divergence(divides_by_h).startswith("wrong: on 'h = h_ref + small noise' at batch row")
    assert check_relative_divergence(in_the_inputs_dtype).startswith(
        "wrong: on 'bf16 inputs' the result is torch.bfloat16")


ABSOLUTE_BAR = 1e-3  # the plausible absolute bar of lesson 11's plot


def test_rounding_only_changes_rounding_by_a_stated_margin(pair):
    """The check's rounding-only case must sit well inside the relative bar and well outside an absolute one on any
    CPU, whatever its kernels' own rounding: under a tenth of the fp32 bar, over five times 1e-3. The model comes back
    bit for bit."""
    ours, theirs, ids = pair
    before = [p.clone() for p in ours.parameters()]
    with rounding_only(ours):
        diffs = hidden_state_diffs(ours, theirs, ids)
    assert max(diffs.relative) < TOLERANCE[torch.float32].hidden_state / 10, max(diffs.relative)
    assert max(diffs.absolute) > 5 * ABSOLUTE_BAR, max(diffs.absolute)
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))


def test_check_find_broken_layer(pair):
    ours, theirs, ids = pair
    solution = _solutions().my_find_broken_layer
    assert check_find_broken_layer(None, ours, theirs, ids).startswith("not attempted yet")
    assert check_find_broken_layer(solution, ours, theirs, ids).startswith("right")

    def stage_index(model, reference, input_ids):  # hidden state i + 1 read as layer i + 1
        layer = solution(model, reference, input_ids)
        return None if layer is None else layer + 1

    def largest_divergence(model, reference, input_ids):  # where it is worst, not where it starts
        relative = hidden_state_diffs(model, reference, input_ids).relative
        return None if max(relative) < 1e-4 else max(range(len(relative)), key=relative.__getitem__) - 1

    def absolute_threshold(model, reference, input_ids):  # max |Δ| > 1e-3: fp32 rounding of large activations
        return first_divergent_layer(hidden_state_diffs(model, reference, input_ids).absolute, ABSOLUTE_BAR)

    assert "off by one" in check_find_broken_layer(stage_index, ours, theirs, ids)
    assert check_find_broken_layer(largest_divergence, ours, theirs, ids).startswith("wrong: with layer 0 broken")
    # misfires on the rounding-only case on any CPU; where its kernels round large activations apart, already on
    # the untouched model
    assert "nothing was broken" in check_find_broken_layer(absolute_threshold, ours, theirs, ids)
    # the check restores the model: the solution still finds nothing broken
    assert solution(ours, theirs, ids) is None


def test_check_diagnosis(pair):
    ours, theirs, ids = pair
    solution = _solutions().my_diagnose
    assert check_diagnosis(None, ours, theirs, ids).startswith("not attempted yet")
    assert check_diagnosis(solution, ours, theirs, ids).startswith("right")

    def always_rope(model, reference, input_ids):  # the most frequent cause, every time
        return "RoPE convention"

    def no_position_signature(model, reference, input_ids):  # cannot tell the mask from GQA without positions
        answer = solution(model, reference, input_ids)
        return "GQA broadcasting" if answer == "causal mask" else answer

    def absolute_measure(model, reference, input_ids):  # "small" by max |Δ|: the ε bug's is > 1 where h is ~2e4
        answer = solution(model, reference, input_ids)
        big = max(hidden_state_diffs(model, reference, input_ids).absolute) > 1
        return "GQA broadcasting" if answer == "RMSNorm epsilon placement" and big else answer

    assert check_diagnosis(always_rope, ours, theirs, ids) == ("wrong: the model had the GQA broadcasting bug; "
                                                                "you said 'RoPE convention'")
    assert check_diagnosis(no_position_signature, ours, theirs, ids).startswith("wrong: the model had the causal mask")
    assert check_diagnosis(absolute_measure, ours, theirs, ids).startswith(
        "wrong: the model had the RMSNorm epsilon placement bug")
    assert "not one of" in check_diagnosis(lambda *a: "rope", ours, theirs, ids)
    # the check restores the model: it agrees with transformers again
    assert first_divergent_layer(hidden_state_diffs(ours, theirs, ids).relative, 1e-4) is None
