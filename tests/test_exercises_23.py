"""Lesson 23's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_23 import (PLANTED, check_first_turn, check_rope_diagnosis, check_yarn_pairs,
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


def test_check_first_turn(sol):
    assert check_first_turn(None).startswith("not attempted yet")
    assert check_first_turn(sol.my_first_turn).startswith("right")
    assert check_first_turn(sol.my_first_turn + 1).startswith("right")  # rounding at the boundary
    plain = sol.yarn_first_turn(15, factor=1.0)
    for wrong, why in ((plain, "plain pair"),  # YaRN forgotten
                       (4 * plain, "fully interpolated"),  # PI's answer: the ramp ignored
                       (sol.yarn_first_turn(14), "ramp's bounds"),  # the neighbouring pair
                       ("2219", "give a number"), (True, "give a number")):
        result = check_first_turn(wrong)
        assert result.startswith("wrong") and why in result, (wrong, result)
