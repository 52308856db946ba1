"""Reference solutions to lesson 25's exercises (notebooks/25_structured_output.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import numpy as np

from hardway.decode.constrained import naive_scan

# Exercise 1: after {"name": "Alice the text is inside a string value. A letter, a space, an escape (backslash-n) or
# any non-control character may follow; a quote closes the string, and then only a comma may come ("age" is
# required), with at most one space around it. `",` is allowed (quote, then comma: both bytes readable), `",\n` is not
# (the newline), nor `"}` (age is missing), `"]` or `":`, nor a raw newline inside the string.
my_allowed = {'"', '",', ' Smith', '\\n', 'é'}


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
