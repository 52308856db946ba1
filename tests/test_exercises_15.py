"""Lesson 15's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear. Every check ends by running a prefix-caching
engine (GPT-2 stand-in) with the learner's piece in place."""

import hashlib

import pytest

from exercise_solutions import load_solutions
from hardway.exercises.lesson_15 import check_block_key, check_match_prefix
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    folder = checkpoint("openai-community/gpt2")
    return load(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def sol():
    return load_solutions("15_prefix_caching")


def test_check_block_key(gpt2, sol):
    model, tok = gpt2
    assert check_block_key(None, model, tok).startswith("not attempted yet")
    result = check_block_key(sol.my_block_key, model, tok)
    assert result.startswith("right"), result

    def unchained(prev_key, token_ids):  # the block's own tokens only
        return hashlib.sha256(bytes(str(token_ids), "ascii")).digest()

    def unordered(prev_key, token_ids):  # a multiset of tokens
        return hashlib.sha256(prev_key + bytes(str(sorted(token_ids)), "ascii")).digest()

    def first_tokens(prev_key, token_ids):  # only the start of the block
        return hashlib.sha256(prev_key + bytes(str(token_ids[:2]), "ascii")).digest()

    def a_list(prev_key, token_ids):  # not hashable
        return [prev_key, *token_ids]

    for wrong_answer, words in [(unchained, "must depend on prev_key"), (unordered, "order of the tokens"),
                                (first_tokens, "every token of the block"), (a_list, "hashable")]:
        wrong = check_block_key(wrong_answer, model, tok)
        assert wrong.startswith("wrong") and words in wrong, (wrong_answer.__name__, wrong)

    def raises(prev_key, token_ids):
        raise NotImplementedError

    assert check_block_key(raises, model, tok).startswith("not attempted yet")


def test_check_match_prefix(gpt2, sol):
    model, tok = gpt2
    assert check_match_prefix(None, model, tok).startswith("not attempted yet")
    result = check_match_prefix(sol.my_match_prefix, model, tok)
    assert result.startswith("right"), result

    def whole_prompt(blocks, token_ids):  # may take every full block, the last token's too
        bs, key, found = blocks.block_size, b"", []
        for i in range(len(token_ids) // bs):
            key = blocks.block_key(key, token_ids[i * bs:(i + 1) * bs])
            if key not in blocks.cached:
                break
            found.append(blocks.cached[key])
        return found

    def one_block_short(blocks, token_ids):  # len // bs - 1: loses a block whenever the prompt is not a multiple
        return sol.my_match_prefix(blocks, token_ids)[:max(len(token_ids) // blocks.block_size - 1, 0)]

    def skips_misses(blocks, token_ids):  # goes on past a miss: a block table with a hole
        bs, key, found = blocks.block_size, b"", []
        for i in range((len(token_ids) - 1) // bs):
            key = blocks.block_key(key, token_ids[i * bs:(i + 1) * bs])
            if key in blocks.cached:
                found.append(blocks.cached[key])
        return found

    def unchained(blocks, token_ids):  # each block's key from b"": only the first block can ever match
        bs, found = blocks.block_size, []
        for i in range((len(token_ids) - 1) // bs):
            block = blocks.cached.get(blocks.block_key(b"", token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            found.append(block)
        return found

    def takes_references(blocks, token_ids):  # does share_prefix's job too: every shared block held twice
        found = sol.my_match_prefix(blocks, token_ids)
        for block in found:
            blocks.ref_counts[block] += 1
        return found

    for wrong_answer, words in [(whole_prompt, "the last token must be computed"), (one_block_short, "9 tokens"),
                                (skips_misses, "a block table with a hole"), (unchained, "A's three full blocks"),
                                (takes_references, "changed reference counts")]:
        wrong = check_match_prefix(wrong_answer, model, tok)
        assert wrong.startswith("wrong") and words in wrong, (wrong_answer.__name__, wrong)
