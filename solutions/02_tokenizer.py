"""Reference solutions to lesson 02's exercises (notebooks/02_tokenizer.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import regex

from hardway.text.bpe import UNICODE_TO_BYTE


# Exercise 1: decode with nothing but tokenizer.json.
def my_decode(spec, ids):
    token_bytes = {i: bytes(UNICODE_TO_BYTE[c] for c in token) for token, i in spec["model"]["vocab"].items()}
    for added in spec["added_tokens"]:
        token_bytes[added["id"]] = added["content"].encode("utf-8")  # special tokens are plain UTF-8 text
    return b"".join(token_bytes[i] for i in ids).decode("utf-8", errors="replace")  # join first, decode once


# Exercise 2: special tokens for a GPT2Tokenizer.
def my_encode_with_specials(tokenizer, text, special_tokens):
    if not special_tokens:
        return tokenizer.encode_ordinary(text)
    # One regex that matches any special token, longest first; the capture group keeps them in the split.
    pattern = "(" + "|".join(regex.escape(s) for s in sorted(special_tokens, key=len, reverse=True)) + ")"
    ids = []
    for k, chunk in enumerate(regex.split(pattern, text)):  # odd k: a special token
        ids.extend([special_tokens[chunk]] if k % 2 else tokenizer.encode_ordinary(chunk))
    return ids
