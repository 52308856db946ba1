"""Lesson 07's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""


import math

import pytest
import torch

from transformers import GPT2Config, GPT2LMHeadModel

from hardway.exercises.lesson_07 import check_min_p_survivors, check_no_repeat_ngram, check_token_logprobs
from hardway.decode.sampling import LogitsProcessor
from exercise_solutions import load_solutions



@pytest.fixture(scope="module")
def solution():
    return load_solutions("07_generation")


def test_check_token_logprobs(solution):
    torch.manual_seed(0)  # a small random GPT-2 is enough: the check only needs transformers' generate and scores
    reference = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64)).eval()
    input_ids = torch.tensor([[464, 2068, 7586, 21831, 18045]])  # (1, 5) "The quick brown fox jumps"
    assert check_token_logprobs(None, reference, input_ids).startswith("not attempted yet")
    assert check_token_logprobs(solution.my_token_logprobs, reference, input_ids).startswith("right")

    def probabilities(scores, tokens):  # forgets the log
        return scores.softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)

    def raw_scores(scores, tokens):  # forgets to normalize: the logit, not a log-probability
        return scores.gather(-1, tokens[..., None]).squeeze(-1)

    def next_token(scores, tokens):  # off by one: step t's distribution scored on step t + 1's token
        return solution.my_token_logprobs(scores, tokens.roll(-1, dims=1))

    def over_steps(scores, tokens):  # log_softmax over the steps instead of the vocabulary
        return scores.log_softmax(dim=1).gather(-1, tokens[..., None]).squeeze(-1)

    for wrong in (probabilities, raw_scores, next_token, over_steps):
        assert check_token_logprobs(wrong, reference, input_ids).startswith("wrong: greedy: at step"), wrong.__name__


def test_check_min_p_survivors(solution):
    assert check_min_p_survivors(None).startswith("not attempted yet")
    assert check_min_p_survivors(solution.my_min_p_survivors).startswith("right")

    def no_temperature(scores, min_p, temperature):  # forgets that temperature scales the logits before the cut
        return solution.my_min_p_survivors(scores, min_p, 1.0)

    def divided(scores, min_p, temperature):  # divides ln(min_p) by T: the cut moves the wrong way with temperature
        cutoff = scores.amax(dim=-1, keepdim=True) + math.log(min_p) / temperature
        return (scores >= cutoff).sum(dim=-1).tolist()

    def absolute(scores, min_p, temperature):  # min_p as a probability floor, not a fraction of the top token's
        return ((scores / temperature).softmax(dim=-1) >= min_p).sum(dim=-1).tolist()

    for wrong in (no_temperature, divided, absolute):
        assert check_min_p_survivors(wrong).startswith("wrong: min_p="), wrong.__name__


def test_check_no_repeat_ngram(solution):
    assert check_no_repeat_ngram(None).startswith("not attempted yet")
    assert check_no_repeat_ngram(solution.MyNoRepeatNGram).startswith("right")

    class PrefixOfN(solution.MyNoRepeatNGram):  # matches the last n tokens instead of n - 1: bans too late
        def __init__(self, ngram_size):
            super().__init__(ngram_size + 1)

    class FirstRowOnly(solution.MyNoRepeatNGram):  # row 0's bans for every row
        def __call__(self, input_ids, scores):
            banned = torch.isinf(super().__call__(input_ids[:1], scores[:1]))  # (1, V)
            return scores.masked_fill(banned.expand_as(scores), float("-inf"))

    class NothingWhenShort(solution.MyNoRepeatNGram):  # waits for n + 1 tokens before banning anything
        def __call__(self, input_ids, scores):
            return scores if input_ids.shape[1] <= self.n else super().__call__(input_ids, scores)

    assert check_no_repeat_ngram(PrefixOfN).startswith("wrong: with ngram_size=1")
    assert check_no_repeat_ngram(FirstRowOnly).startswith("wrong:")
    assert "after 1 tokens" in check_no_repeat_ngram(NothingWhenShort)
