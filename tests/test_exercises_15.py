"""Lesson 15's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear. The first two measure on the real engine with
the lesson's model (SmolLM2 stand-in): the chat's prefix hits per turn, and the tokens a shared system prompt saves;
the third names where a planted mistake is, and a test proves it is there."""

import pytest

from exercise_solutions import load_solutions
from hardway.engine.block_manager import PrefixCachingBlockManager
from hardway.engine.sequence import SamplingParams, Sequence
from hardway.exercises.lesson_15 import (METHODS, PLANTED_METHOD, check_planted_method, check_saved_tokens,
                                         check_token_prefix, planted_block_manager)
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.text.chat import ChatTemplate
from hardway.text.tokenizer import load_tokenizer

SYSTEM = ("You are the help desk of a small public library. The library opens at nine and closes at six, Monday to "
          "Saturday. Members may borrow up to eight books for three weeks, and renew each loan twice.")
TURNS = ["Hi! When do you open?", "And on Sunday?", "Can I print in colour?", "How much for ten pages?"]


@pytest.fixture(scope="module")
def smollm():
    folder = checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    return load(folder), load_tokenizer(folder), ChatTemplate.from_folder(folder)


@pytest.fixture(scope="module")
def sol():
    return load_solutions("15_prefix_caching")


def test_check_token_prefix(smollm, sol):
    model, tok, chat = smollm

    def check(fn, most_lost):
        return check_token_prefix(fn, most_lost, model, tok, chat, SYSTEM, TURNS)

    assert check(None, 15).startswith("not attempted yet")
    assert check(sol.my_token_prefix, None).startswith("not attempted yet")  # the function first, then the number
    result = check(sol.my_token_prefix, sol.my_most_lost)
    assert result.startswith("right"), result

    def whole_prompt(cached, token_ids):  # forgets that the last token is computed anyway
        return max((next((i for i, (a, b) in enumerate(zip(c, token_ids)) if a != b), min(len(c), len(token_ids)))
                    for c in cached), default=0)

    def counts_agreements(cached, token_ids):  # counts equal positions, past the first difference
        return min(max((sum(a == b for a, b in zip(c, token_ids)) for c in cached), default=0), len(token_ids) - 1)

    def latest_only(cached, token_ids):  # looks in the most recent sequence only, as if a chat had one history
        return sol.my_token_prefix(cached[-1:], token_ids)

    def by_blocks(cached, token_ids):  # rounds down to blocks of 16: the lesson's cache, not token matching
        return sol.my_token_prefix(cached, token_ids) // 16 * 16

    for wrong_answer, words in [(whole_prompt, "last token"), (counts_agreements, "agree again"),
                                (latest_only, "the longest wins"), (by_blocks, "after three")]:
        wrong = check(wrong_answer, sol.my_most_lost)
        assert wrong.startswith("wrong") and words in wrong, (wrong_answer.__name__, wrong)

    # A whole block (16): a lost tail of 16 would be a full block, found. Half a block (8): the average loss, not
    # the most; the chat's turns lose more than that.
    for most_lost in (16, 8):
        wrong = check(sol.my_token_prefix, most_lost)
        assert wrong.startswith("wrong") and "lost per turn" in wrong, (most_lost, wrong)


def test_check_saved_tokens(smollm, sol):
    model, tok, _ = smollm
    assert check_saved_tokens(None, model, tok).startswith("not attempted yet")
    result = check_saved_tokens(sol.my_saved_tokens, model, tok)
    assert result.startswith("right"), result

    def whole_system_prompt(n, m, b, together):  # forgets that the system prompt's partial block is recomputed
        return 0 if together else (m - 1) * n

    def first_one_too(n, m, b, together):  # forgets that the first request finds an empty cache
        return 0 if together else m * (n // b) * b

    def together_as_well(n, m, b, together):  # forgets that blocks get keys once computed, and lookups at admission
        return (m - 1) * (n // b) * b

    def last_token_rule(n, m, b, together):  # applies "the last token is computed" to the system prompt's end
        return 0 if together else (m - 1) * ((n - 1) // b) * b

    for wrong_answer, words in [(whole_system_prompt, "40 tokens, blocks of 16"), (first_one_too, "counted 96"),
                                (together_as_well, "together"), (last_token_rule, "48 tokens")]:
        wrong = check_saved_tokens(wrong_answer, model, tok)
        assert wrong.startswith("wrong") and words in wrong, (wrong_answer.__name__, wrong)


def walk(blocks):
    """Section 2's walk: A's 14 tokens computed and finished, then B shares A's first two blocks -> B's sequence."""
    a = Sequence(list(range(1, 13)) + [20, 21], SamplingParams())
    blocks.grow(a.block_table, len(a.tokens))
    a.n_cached = len(a.tokens)
    blocks.cache_blocks(a)
    blocks.release(a.block_table)
    b = Sequence(list(range(1, 9)) + [30, 31, 32, 33, 34], SamplingParams())
    b.n_cached = blocks.share_prefix(b)
    return b


def test_the_planted_mistake_is_where_the_check_says():
    """The planted block manager leaves a shared block both held and evictable; with the lesson's share_prefix in
    place of its own, the same walk is right, so the mistake is in share_prefix alone."""
    planted = planted_block_manager(7, 4)
    b = walk(planted)
    assert b.block_table and all(planted.ref_counts[k] == 1 and k in planted.evictable for k in b.block_table)
    fixed = planted_block_manager(7, 4)
    fixed.share_prefix = PrefixCachingBlockManager.share_prefix.__get__(fixed)
    b = walk(fixed)
    assert b.block_table and not any(k in fixed.evictable for k in b.block_table)
    assert PLANTED_METHOD == "share_prefix" and PLANTED_METHOD in METHODS


def test_check_planted_method(sol):
    assert check_planted_method(None).startswith("not attempted yet")
    result = check_planted_method(sol.my_diagnosis)
    assert result.startswith("right"), result
    # evict: where the damage shows (it hands out a block a request still reads), not where it was done. release:
    # it is the method that puts blocks in `evictable`. A bare string: the answer without the dict asked for.
    for wrong_answer, words in [({"method": "evict"}, "not in evict"), ({"method": "release"}, "not in release"),
                                ("share_prefix", "give a dict"), ({"method": "share"}, "must be one of")]:
        wrong = check_planted_method(wrong_answer)
        assert wrong.startswith("wrong") and words in wrong, (wrong_answer, wrong)
