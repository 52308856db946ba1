"""Lesson 25's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest

from exercise_solutions import load_solutions
from hardway.exercises.lesson_25 import (BUGS, CANDIDATES, check_mask_cache_bytes, check_mask_prediction,
                                         check_planted_bug, check_range_regex, planted_automaton)
from hardway.formats.hub import checkpoint
from hardway.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def sol():
    return load_solutions("25_structured_output")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct"))


def test_check_mask_prediction(sol, tokenizer):
    assert check_mask_prediction(None).startswith("not attempted yet")
    assert check_mask_prediction(sol.my_allowed).startswith("right")
    assert all(c.encode() in tokenizer.encoder for c in CANDIDATES)  # every candidate is a token of the vocabulary
    # Plausible: thinking of the output in JSON pieces, a token that spans the comma and the next key looks wrong.
    result = check_mask_prediction(sol.my_allowed - {',"'})
    assert result.startswith("wrong") and "trap" in result
    # Plausible: thinking every property is required, so the object may not close after the age.
    result = check_mask_prediction(sol.my_allowed - {'}'})
    assert result.startswith("wrong") and "optional" in result
    # Plausible: a number's fraction, as JSON's numbers allow, for an integer.
    result = check_mask_prediction(sol.my_allowed | {'.'})
    assert result.startswith("wrong") and "integer" in result
    # Plausible: the object closes and a comma follows, as inside a list.
    result = check_mask_prediction(sol.my_allowed | {'},'})
    assert result.startswith("wrong") and "only EOS" in result
    # Plausible: any whitespace, as JSON itself allows.
    result = check_mask_prediction(sol.my_allowed | {'  '})
    assert result.startswith("wrong") and "one space" in result
    assert "not one of the candidates" in check_mask_prediction({"Smith"})


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
        return "(?!0)[0-9]{1,4}"

    assert "matches" in check_range_regex(digits_only)
    assert check_range_regex(leading_zeros).startswith("wrong")
    assert "characters" in check_range_regex(listing)
    assert "not supported" in check_range_regex(lookahead)


def test_check_mask_cache_bytes(sol, tokenizer):
    assert check_mask_cache_bytes(None).startswith("not attempted yet")
    assert check_mask_cache_bytes(sol.my_mask_cache_bytes).startswith("right")
    for wrong, why in (
            (lambda n, w, v, width: (n * v + w * 5 * width) / 8, "not a bit"),  # bits, as a packed mask would be
            (lambda n, w, v, width: n * v + w * width, "the bias is fp32"),  # the widened mask only
            (lambda n, w, v, width: n * v + w * 4 * width, "keeps the widened bool mask too"),  # the bias only
            (lambda n, w, v, width: w * 5 * width, "keeps each state's (V,) mask"),  # the step's caches only
            (lambda n, w, v, width: n * width + w * 5 * width, "as wide as the vocabulary"),  # width for V
            (lambda n, w, v, width: n * (v + 5 * width), "n_wide"),  # one widened entry per mask
            (lambda n, w, v, width: "295 KB", "a number of bytes")):
        result = check_mask_cache_bytes(wrong)
        assert result.startswith("wrong") and why in result, result
    # measured: an automaton that has computed masks and a step's bias
    automaton = planted_automaton(tokenizer)  # any TokenAutomaton: its caches are what is measured
    state = automaton.start
    automaton.allowed(state)
    automaton.bias_for(state, automaton.vocab_size + 64, "cpu")  # logits wider than the vocabulary
    result = check_mask_cache_bytes(sol.my_mask_cache_bytes, automaton)
    assert result.startswith("right") and "as you predicted" in result and "GB" in result, result
    result = check_mask_cache_bytes(lambda n, w, v, width: n * v + w * 5 * v if n > 100 else n * v + w * 5 * width,
                                    automaton)
    assert result.startswith("right")  # the width is the logits', as measured
    off_here = lambda n, w, v, width: sol.my_mask_cache_bytes(n, w, v, width) + (width == v + 64)  # noqa: E731
    result = check_mask_cache_bytes(off_here, automaton)
    assert result.startswith("wrong") and "the automaton holds" in result, result
