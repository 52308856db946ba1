"""Lesson 18's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers for the reason a learner would need to hear. The rule diagnosis's answer key is itself
measured here with section 4's instrument; the tokens-per-step check ends with a measurement."""

import tempfile

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_18 import (KEEPS, RIGHT_FOR_LOOKUP, SUSPECT_RULES, check_expected_tokens,
                                         check_rule_diagnosis)
from hardway.decode.speculative import accept_sampled
from hardway.instruments.distributions import two_token_tables
from hardway.loading import load

V = 8


def tiny_llama(weights: int):
    """The lesson's vocabulary-8 Llama (section 4), random weights drawn wide."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(weights)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    path = tempfile.mkdtemp()
    hf.save_pretrained(path)
    return load(path)


@pytest.fixture(scope="module")
def sol():
    return load_solutions("18_speculative_decoding")


def test_the_answer_key_is_what_the_instrument_measures(sol):
    """The check knows the answer; this proves the answer: section 4's test, on section 4's tables, with guesses drawn
    by a model and with one-hot guesses, separates the rules exactly as the key says, and accept_sampled passes both."""
    tables = two_token_tables(tiny_llama(1), tiny_llama(2), torch.tensor([3, 1, 4, 1, 5]))
    exact = tables["p1"][:, None] * tables["p2"]  # (V, V)
    p_values, keeps, lookup_only = sol.diagnose_rules(SUSPECT_RULES | {"reference": accept_sampled}, tables, exact)
    assert keeps == KEEPS | {"reference"}, p_values
    assert lookup_only == {RIGHT_FOR_LOOKUP}, p_values
    assert sol.my_diagnosis == {"keeps": KEEPS, "right_for_lookup": RIGHT_FOR_LOOKUP}


def test_check_rule_diagnosis(sol):
    assert check_rule_diagnosis(None).startswith("not attempted yet")
    result = check_rule_diagnosis(sol.my_diagnosis)
    assert result.startswith("right"), result
    assert check_rule_diagnosis({"keeps": ["d", "e"], "right_for_lookup": "b"}).startswith("right")  # any spelling
    for wrong_answer, words in [
        # Trusted the code's looks: every rule reads like accept_sampled.
        ({"keeps": set(SUSPECT_RULES), "right_for_lookup": "B"}, "rule A does not keep"),
        # Tested with prompt lookup's one-hot guesses only, where B passes.
        ({"keeps": {"B", "D", "E"}, "right_for_lookup": "B"}, "Did you test it with one-hot guesses?"),
        # Read a p-value of a few percent as a failure (or judged the log-space rewrite by its looks).
        ({"keeps": {"E"}, "right_for_lookup": "B"}, "rule D keeps the model's distribution"),
        # Named a right rule for the second question: it is right for lookup, but not the broken one asked for.
        ({"keeps": {"D", "E"}, "right_for_lookup": "D"}, "right for every drafter"),
        # Guessed C (the shared uniform) is harmless when q is one-hot: it is not.
        ({"keeps": {"D", "E"}, "right_for_lookup": "C"}, "fails with one-hot guesses too"),
        # The answer as a string of letters, not a set.
        ({"keeps": "DE", "right_for_lookup": "B"}, "a set of letters"),
        # Only the first half of the answer.
        ({"keeps": {"D", "E"}}, "two keys"),
    ]:
        wrong = check_rule_diagnosis(wrong_answer)
        assert wrong.startswith("wrong") and words in wrong, (wrong_answer, wrong)


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
