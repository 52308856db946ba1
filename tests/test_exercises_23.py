"""Lesson 23's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import math

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_23 import (PLANTED, check_bf16_angle_error, check_rope_diagnosis, check_yarn_pairs,
                                         planted_dynamic_rope)
from hardway.models.llama import RotaryEmbedding
from hardway.models.rope_scaling import dynamic_parameters, length_dependent_inv_freq


@pytest.fixture(scope="module")
def sol():
    return load_solutions("23_long_context")


def test_check_yarn_pairs(sol):
    assert check_yarn_pairs(None).startswith("not attempted yet")
    result = check_yarn_pairs(sol.my_yarn_pairs)
    assert result.startswith("right"), result
    kept, interpolated = sol.my_yarn_pairs["kept"], sol.my_yarn_pairs["interpolated"]
    for wrong, why in (
            # the bounds rounded inwards (ceil for the fast end, floor for the slow): one pair off at each end
            ({"kept": kept + [kept[-1] + 1], "interpolated": interpolated}, "rounded outwards"),
            # the pair at the bound itself left out: its ramp is exactly 0
            ({"kept": kept[:-1], "interpolated": interpolated}, "rounded outwards"),
            # the betas swapped: beta_slow's pair taken as the end of the kept ones
            ({"kept": list(range(0, interpolated[0] + 1)), "interpolated": list(range(kept[-1], 64))}, "beta_fast"),
            # d/2 for d in the pair formula: every bound halved
            (sol.yarn_split(64, 1_000_000.0, 32768), "beta_fast"),
            ({"kept": kept}, "give a dict"),
            ({"kept": "0..23", "interpolated": interpolated}, "list of pair indices")):
        result = check_yarn_pairs(wrong)
        assert result.startswith("wrong") and why in result, (wrong, result)


def rotation(inv_freq, positions, scaling, dtype):
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


class CountsTokens(RotaryEmbedding):
    """Mistake C: the length of a pass is its number of tokens."""

    def forward(self, positions, dtype):
        inv_freq = length_dependent_inv_freq(self, torch.arange(positions.shape[-1]))
        return rotation(inv_freq, positions, self.attention_scaling, dtype)


class NeverResets(RotaryEmbedding):
    """Mistake D: the remembered length only grows."""

    def forward(self, positions, dtype):
        trained = self.config.rope_scaling["original_max_position_embeddings"]
        length = torch.maximum(self.scaling_length, positions.max() + 1)
        self.scaling_length.copy_(length)
        params = {"rope_theta": self.config.rope_theta, **self.config.rope_scaling}
        stretched, _ = dynamic_parameters(params, self.config.head_dim, trained, seq_len=length)
        inv_freq = torch.where(length > trained, stretched, self.original_inv_freq)
        return rotation(inv_freq, positions, self.attention_scaling, dtype)


def test_check_rope_diagnosis(sol):
    assert check_rope_diagnosis(None).startswith("not attempted yet")
    # the solution's probes find what was planted, tell the other mistakes apart, and pass the real one
    assert sol.diagnose_dynamic(planted_dynamic_rope) == PLANTED == sol.my_rope_diagnosis
    assert sol.diagnose_dynamic(CountsTokens) == "C" and sol.diagnose_dynamic(NeverResets) == "D"
    assert sol.diagnose_dynamic(RotaryEmbedding) is None
    result = check_rope_diagnosis(sol.my_rope_diagnosis)
    assert result.startswith("right"), result
    for wrong, why in (("A", "attention factor of 'dynamic' is 1"),  # the first bug on the list, untested
                       ("C", "one-token decode step"),  # decoding differs: the other decode-time mistake
                       ("D", "shorter than it"),
                       ("b", "answer one of"), (2, "answer one of")):
        result = check_rope_diagnosis(wrong)
        assert result.startswith("wrong") and why in result, (wrong, result)


def test_check_bf16_angle_error(sol):
    assert check_bf16_angle_error(None).startswith("not attempted yet")
    result = check_bf16_angle_error(sol.my_bf16_angle_error)
    assert result.startswith("right") and "131072: 256 rad" in result, result

    def exponent(m):  # the largest position's exponent, written here as a learner would
        return math.floor(math.log2(m - 1))

    for wrong, why in (
            (lambda m: 2.0 ** (exponent(m) - 7), "half the step"),  # the whole step between two bf16 numbers
            (lambda m: 2.0 ** (exponent(m) - 11), "fp16"),  # fp16's 11 significant bits
            (lambda m: 2.0 ** (exponent(m) - 6), "implicit leading 1"),  # 7 bits, and the whole step
            (lambda m: 2.0 ** (math.floor(math.log2(m)) - 8), "m - 1, not m"),  # the exponent of m itself
            (lambda m: 0.0, "only up to 256"),  # integers are exact: in fp32 up to 2^24, not in bf16
            (lambda m: m * 2.0 ** -8, "the step between two bf16 numbers"),  # a relative error, not a step
            (lambda m: "8 rad", "a number of radians")):
        result = check_bf16_angle_error(wrong)
        assert result.startswith("wrong") and why in result, result
