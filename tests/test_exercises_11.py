"""Lesson 11's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers. On the SmolLM2-135M stand-in, fp32, CPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

from hardway.exercises import check_find_broken_layer, check_misplaced_eps, check_relative_divergence
from hardway.hub import checkpoint
from hardway.loading import load
from hardway.tokenizer import load_tokenizer
from hardway.verify import DEFAULT_PROMPT, first_divergent_layer, hidden_state_diffs, load_reference

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _solutions():
    spec = importlib.util.spec_from_file_location("solutions_11", ROOT / "solutions" / "11_verification_ritual.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
        return first_divergent_layer(hidden_state_diffs(model, reference, input_ids).absolute, 1e-3)

    assert "off by one" in check_find_broken_layer(stage_index, ours, theirs, ids)
    assert check_find_broken_layer(largest_divergence, ours, theirs, ids).startswith("wrong: with layer 0 broken")
    assert "nothing was broken" in check_find_broken_layer(absolute_threshold, ours, theirs, ids)
    # the check restores the model: the solution still finds nothing broken
    assert solution(ours, theirs, ids) is None


def test_check_misplaced_eps(pair):
    ours, theirs, ids = pair
    s = _solutions()
    assert check_misplaced_eps(None, None, ours, theirs, ids).startswith("not attempted yet")
    assert check_misplaced_eps(s.my_rmsnorm_eps_after_sqrt, None, ours, theirs, ids).startswith(
        "not attempted yet: your RMSNorm is right")
    assert check_misplaced_eps(s.my_rmsnorm_eps_after_sqrt, s.my_prediction, ours, theirs, ids).startswith("right")

    def correct_rmsnorm(x, weight, eps):  # ε under the root: the right norm, not the exercise's
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def no_eps(x, weight, eps):
        return weight * (x / x.pow(2).mean(-1, keepdim=True).sqrt())

    def eps_on_the_mean_square(x, weight, eps):  # x / (mean(x²) + ε): forgets the root
        return weight * (x / (x.pow(2).mean(-1, keepdim=True) + eps))

    assert "that is the correct RMSNorm" in check_misplaced_eps(correct_rmsnorm, s.my_prediction, ours, theirs, ids)
    assert check_misplaced_eps(no_eps, s.my_prediction, ours, theirs, ids).startswith("wrong: your RMSNorm differs")
    assert check_misplaced_eps(eps_on_the_mean_square, s.my_prediction, ours, theirs, ids).startswith(
        "wrong: your RMSNorm differs")
    # "too small to see", "any bug flips a token", "too small to fail the logits check"
    for key, guess in (("first_divergent_layer", None), ("greedy_tokens_identical", False),
                       ("logits_check_passes", True)):
        verdict = check_misplaced_eps(s.my_rmsnorm_eps_after_sqrt, {**s.my_prediction, key: guess}, ours, theirs, ids)
        assert verdict.startswith("wrong: ") and f"{key}: you predicted {guess!r}" in verdict, verdict
    # the check restores RMSNorm: the model agrees with transformers again
    assert first_divergent_layer(hidden_state_diffs(ours, theirs, ids).relative, 1e-4) is None
