"""Lesson 25's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest

from exercise_solutions import load_solutions
from hardway.exercises.lesson_25 import (BUGS, check_mask_prediction, check_planted_bug, check_range_regex,
                                         planted_automaton)
from hardway.formats.hub import checkpoint
from hardway.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def sol():
    return load_solutions("25_structured_output")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct"))


def test_check_mask_prediction(sol):
    assert check_mask_prediction(None).startswith("not attempted yet")
    assert check_mask_prediction(sol.my_allowed).startswith("right")
    # Plausible: thinking of the output in JSON pieces, a token that spans the string's end and the comma looks wrong.
    result = check_mask_prediction(sol.my_allowed - {'",'})
    assert result.startswith("wrong") and "trap" in result
    # Plausible: forgetting that "age" is required, so the object may close after the name.
    result = check_mask_prediction(sol.my_allowed | {'"}'})
    assert result.startswith("wrong") and "required" in result
    # Plausible: allowing any whitespace after the comma, as JSON itself does.
    result = check_mask_prediction(sol.my_allowed | {'",\n'})
    assert result.startswith("wrong") and "one space" in result
    # Plausible: a raw newline, as if a string could hold any character.
    assert check_mask_prediction(sol.my_allowed | {"\n"}).startswith("wrong")


def test_check_planted_bug(sol, tokenizer):
    answer = sol.find_planted_bug(planted_automaton(tokenizer), tokenizer)
    assert check_planted_bug(None, tokenizer).startswith("not attempted yet")
    result = check_planted_bug(answer, tokenizer)
    assert result.startswith("right"), result
    bug, state, token = answer
    # Plausible: the right witness, the wrong name (EOS is the first thing people suspect in a mask).
    result = check_planted_bug((BUGS[0], state, token), tokenizer)
    assert result.startswith("wrong") and "not EOS" in result
    # Plausible: a token the mask rightly allows (the quote that opens the first key), taken for a bug.
    quote = tokenizer.encoder[b'{"']
    result = check_planted_bug((bug, state, quote), tokenizer)
    assert result.startswith("wrong") and "right to be allowed" in result
    # Plausible: EOS in the start state, guessed without looking: the planted automaton does not allow it.
    result = check_planted_bug((BUGS[0], state, 2), tokenizer)
    assert result.startswith("wrong") and "no witness" in result


def test_check_range_regex(sol):
    assert check_range_regex(None).startswith("not attempted yet")
    assert check_range_regex(sol.my_range_regex).startswith("right")

    def digits_only(lo, hi):  # plausible: the right number of digits, with no bounds on their values
        return "[0-9]{%d,%d}" % (len(str(lo)), len(str(hi)))

    def leading_zeros(lo, hi):  # plausible: right bounds, but fixed-width numbers, zero-padded
        return sol.my_range_regex(lo, hi)[:-1] + "|0[0-9]*)"

    def listing(lo, hi):  # plausible: every number written out: right, but not the idea
        return "(" + "|".join(str(n) for n in range(lo, hi + 1)) + ")"

    def lookahead(lo, hi):  # plausible: a construct outside the subset
        return f"(?!0)[0-9]{{1,4}}"

    assert "matches" in check_range_regex(digits_only)
    assert check_range_regex(leading_zeros).startswith("wrong")
    assert "characters" in check_range_regex(listing)
    assert "not supported" in check_range_regex(lookahead)
