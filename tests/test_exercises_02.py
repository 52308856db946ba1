"""Lesson 02's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""


import pytest

from hardway.text.bpe import GPT2Tokenizer, UNICODE_TO_BYTE, train_bpe
from hardway.exercises.lesson_02 import check_decode, check_encode_with_specials
from hardway.formats.hub import checkpoint, shakespeare_path
from exercise_solutions import load_solutions



@pytest.fixture(scope="module")
def solution():
    return load_solutions("02_tokenizer")


@pytest.fixture(scope="module")
def llama_json():
    return checkpoint("meta-llama/Llama-3.2-tokenizer") / "tokenizer.json"


@pytest.fixture(scope="module")
def toy():
    merges, vocab = train_bpe(shakespeare_path().read_text(encoding="utf-8")[:200_000], 400)
    return GPT2Tokenizer.from_bpe(merges, vocab)


def test_check_decode(solution, llama_json):
    assert check_decode(None, llama_json).startswith("not attempted yet")
    assert check_decode(solution.my_decode, llama_json).startswith("right")

    def spelled(spec, ids):  # forgets the byte table: "ĠThe" instead of " The"
        names = {i: t for t, i in spec["model"]["vocab"].items()} | {t["id"]: t["content"] for t in spec["added_tokens"]}
        return "".join(names[i] for i in ids)

    def token_by_token(spec, ids):  # decodes each token alone: a character split over two tokens becomes two �
        return "".join(solution.my_decode(spec, [i]) for i in ids)

    def strict(spec, ids):  # errors="strict": half a character raises
        table = {i: bytes(UNICODE_TO_BYTE[c] for c in t) for t, i in spec["model"]["vocab"].items()}
        table |= {t["id"]: t["content"].encode() for t in spec["added_tokens"]}
        return b"".join(table[i] for i in ids).decode("utf-8")

    def skips_specials(spec, ids):
        added = {t["id"] for t in spec["added_tokens"]}
        return solution.my_decode(spec, [i for i in ids if i not in added])

    assert "got 'Ġquick" in check_decode(spelled, llama_json)
    assert check_decode(token_by_token, llama_json).startswith("wrong: decoding")
    assert "UnicodeDecodeError" in check_decode(strict, llama_json)
    assert "<|begin_of_text|>" in check_decode(skips_specials, llama_json)


def test_check_encode_with_specials(solution, toy):
    assert check_encode_with_specials(None, toy).startswith("not attempted yet")
    assert check_encode_with_specials(solution.my_encode_with_specials, toy).startswith("right")

    def plain(tokenizer, text, special_tokens):  # no special tokens at all
        return tokenizer.encode_ordinary(text)

    def dropped(tokenizer, text, special_tokens):  # cuts the specials out but forgets their ids
        return [i for i in solution.my_encode_with_specials(tokenizer, text, special_tokens)
                if i not in special_tokens.values()]

    def only_first(tokenizer, text, special_tokens):  # handles only the first special token in the dict
        first = dict(list(special_tokens.items())[:1])
        return solution.my_encode_with_specials(tokenizer, text, first)

    def whole_text_then_replace(tokenizer, text, special_tokens):  # encodes across the special tokens' borders
        ids = tokenizer.encode_ordinary(text.replace("<|endoftext|>", "\x00"))
        return [special_tokens["<|endoftext|>"] if i == tokenizer.byte_ids[0] else i for i in ids]

    for wrong in (plain, dropped, only_first, whole_text_then_replace):
        assert check_encode_with_specials(wrong, toy).startswith("wrong: encoding"), wrong.__name__
