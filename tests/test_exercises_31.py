"""Lesson 31's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_31 import check_mxfp4_block, check_sink_probs


@pytest.fixture(scope="module")
def sol():
    return load_solutions("31_sinks_and_mxfp4")


def test_check_sink_probs(sol):
    assert check_sink_probs(None).startswith("not attempted yet")
    assert check_sink_probs(sol.my_sink_probs).startswith("right")

    def plain(scores, sink):
        return torch.softmax(scores, dim=-1)

    def no_max(scores, sink):  # the maximum not subtracted: fine, but where every key is masked? still finite
        logits = torch.cat([scores, sink[:, None, None].expand(*scores.shape[:2], 1)], dim=-1)
        return torch.softmax(logits, dim=-1)[..., :-1]

    def sink_first(scores, sink):
        logits = torch.cat([sink[:, None, None].expand(*scores.shape[:2], 1), scores], dim=-1)
        return torch.softmax(logits, dim=-1)[..., :-1]

    def added_to_scores(scores, sink):
        return torch.softmax(scores + sink[:, None, None], dim=-1)

    def sink_in_numerator(scores, sink):  # e^s / (Σ e^score) added: not a probability
        return torch.softmax(scores, dim=-1) * torch.sigmoid(-sink)[:, None, None]

    assert check_sink_probs(no_max).startswith("right")  # the same numbers: a sink keeps every row finite
    assert "plain softmax" in check_sink_probs(plain)
    assert "the last column dropped was a key" in check_sink_probs(sink_first)
    assert "plain softmax" in check_sink_probs(added_to_scores)
    assert check_sink_probs(sink_in_numerator).startswith("wrong")


def test_check_mxfp4_block(sol):
    assert check_mxfp4_block(None).startswith("not attempted yet")
    assert check_mxfp4_block(sol.my_mxfp4_block).startswith("right")
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

    def openai_order(raw):
        codes = torch.stack([raw[1:] & 0x0F, raw[1:] >> 4], dim=-1).flatten().long()
        return values[codes] * 2.0 ** (int(raw[0]) - 127)

    def bias_128(raw):
        return sol.my_mxfp4_block(raw) / 2

    def unsigned(raw):
        return sol.my_mxfp4_block(raw).abs()

    def int_codes(raw):  # the code as an integer (Q4_0's habit)
        codes = torch.cat([raw[1:] & 0x0F, raw[1:] >> 4]).float()
        return codes * 2.0 ** (int(raw[0]) - 127)

    assert "openai's order" in check_mxfp4_block(openai_order)
    assert "factor of two" in check_mxfp4_block(bias_128)
    assert "no negative weights" in check_mxfp4_block(unsigned)
    assert check_mxfp4_block(int_codes).startswith("wrong")
