"""Lesson 18's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers for the reason a learner would need to hear. The greedy rule's check ends inside
speculative_generate against generate (GPT-2 stand-in); the tokens-per-step check ends with a measurement."""

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_18 import check_accept_greedy, check_expected_tokens
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    folder = checkpoint("openai-community/gpt2")
    tok = load_tokenizer(folder)
    return load(folder), torch.tensor([tok.encode("one two three four, one two three four, one two three")])


@pytest.fixture(scope="module")
def sol():
    return load_solutions("18_speculative_decoding")


def test_check_accept_greedy(gpt2, sol):
    model, ids = gpt2
    assert check_accept_greedy(None, model, ids).startswith("not attempted yet")
    result = check_accept_greedy(sol.my_accept_greedy, model, ids)
    assert result.startswith("right"), result

    def counts_every_match(draft, choices):  # matches after a disagreement counted too
        return sum(d == c for d, c in zip(draft, choices))

    def shifted(draft, choices):  # compares guess i with choices[i + 1]
        kept = 0
        for d, c in zip(draft, choices[1:]):
            if d != c:
                break
            kept += 1
        return kept

    def with_the_models_token(draft, choices):  # counts the model's own token as a kept guess
        return sol.my_accept_greedy(draft, choices) + 1

    def keeps_all(draft, choices):
        return len(draft)

    def a_list(draft, choices):  # the tokens, not how many
        return draft[:sol.my_accept_greedy(draft, choices)]

    for wrong_answer, words in [(counts_every_match, "the later ones followed a token that is gone"),
                                (shifted, "every guess is the model's choice"),
                                (with_the_models_token, "every guess is the model's choice"),
                                (keeps_all, "the first guess is wrong"), (a_list, "return an int")]:
        wrong = check_accept_greedy(wrong_answer, model, ids)
        assert wrong.startswith("wrong") and words in wrong, (wrong_answer.__name__, wrong)

    def raises(draft, choices):
        raise NotImplementedError

    assert check_accept_greedy(raises, model, ids).startswith("not attempted yet")


def test_check_expected_tokens(sol):
    assert check_expected_tokens(None).startswith("not attempted yet")
    result = check_expected_tokens(sol.my_expected_tokens)
    assert result.startswith("right") and "measured" in result, result

    def no_models_token(a, k):  # forgets the token the model adds itself
        return sol.my_expected_tokens(a, k) - 1

    def one_term_short(a, k):  # (1 - a^k) / (1 - a)
        return k if a == 1 else (1 - a ** k) / (1 - a)

    def independent_guesses(a, k):  # every guess kept with probability a, whatever came before it
        return 1 + k * a

    def divides_by_zero(a, k):  # the closed form without its limit
        return (1 - a ** (k + 1)) / (1 - a)

    for wrong_answer, words in [(no_models_token, "every step adds the model's own token"),
                                (one_term_short, "guess i is kept only if"),
                                (independent_guesses, "guess i is kept only if"),
                                (divides_by_zero, "ZeroDivisionError")]:
        wrong = check_expected_tokens(wrong_answer)
        assert wrong.startswith("wrong") and words in wrong, (wrong_answer.__name__, wrong)
