"""Reference solutions to lesson 25's exercises (notebooks/25_structured_output.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import numpy as np

from hardway.decode.constrained import naive_scan

# Exercise 1: after {"name": "Alice", "age": 3 the text is inside an integer that does not start with 0: another
# digit may follow, or the age may end. "email" is optional, so after it come a comma (then the "email" key) or the
# closing brace, with at most one space around either. `,"` is allowed (the comma, then the quote that opens "email":
# both bytes readable); `},` is not (nothing follows the object but EOS), nor two spaces, nor `.`, `e` or `"`: an
# integer has no fraction, no exponent and no quotes.
my_allowed = {'0', '}', ',', ' }', ',"'}


# Exercise 2: compare the planted automaton's masks with the naive scan (which reads every byte of every token) on
# the states of a valid text; the first difference is a witness. EOS is allowed exactly where dfa.accepting says, so
# the difference is an ordinary token: one that starts with an allowed token and then leaves the grammar.
def find_planted_bug(mystery, tokenizer):
    text = tokenizer.encode('{"name": "Alice", "age": 30}', add_special_tokens=False)
    state = mystery.start
    for token in text:
        planted = mystery.allowed(state).numpy()
        correct = naive_scan(mystery.dfa, mystery.vocabulary, state)
        correct[mystery.eos_token_ids] = bool(mystery.dfa.accepting[state])
        extra = np.flatnonzero(planted & ~correct)
        if len(extra):
            return ("the trie walk stops at the first token on a path", int(state), int(extra[0]))
        state = mystery.advance(state, token)
    return None


# Exercise 3: split [lo, hi] by the number of digits, then into blocks "a fixed prefix, then k free digits"
# (start a multiple of 10^k, as wide as fits), and write the blocks that share everything but one digit as a class.
def my_range_regex(lo, hi):
    options = []
    for digits in range(1, 5):
        low, high = max(lo, 0 if digits == 1 else 10 ** (digits - 1)), min(hi, 10 ** digits - 1)
        start = low
        while start <= high:
            k = 0  # the widest block [start, start + 10^k - 1] inside [start, high]
            while k + 1 < digits and start % 10 ** (k + 1) == 0 and start + 10 ** (k + 1) - 1 <= high:
                k += 1
            # consecutive blocks of the same width that differ only in the digit before the free ones: one class
            step = 10 ** k
            end_digit = start // step % 10
            while end_digit < 9 and start + (end_digit - start // step % 10 + 2) * step - 1 <= high:
                end_digit += 1
            first_digit = start // step % 10
            prefix = str(start // step // 10) if start // step >= 10 else ""
            cls = str(first_digit) if first_digit == end_digit else f"[{first_digit}-{end_digit}]"
            options.append(prefix + cls + ("[0-9]" * k))
            start += (end_digit - first_digit + 1) * step
    return "(" + "|".join(options) + ")"


# Exercise 4: allowed() keeps a (V,) torch.bool per state, a byte a token (torch does not pack bits); bias_for keeps,
# per (state, width, device), the widened (width,) bool mask and the (width,) fp32 bias: 5 bytes a token. On
# SmolLM2's 49,152 tokens a state the step has used costs about 295 KB, and 50,000 of them about 15 GB.
def my_mask_cache_bytes(n_masks, n_wide, vocab_size, width):
    return n_masks * vocab_size + n_wide * (width + 4 * width)
