"""Reference solutions to lesson 18's exercises (notebooks/18_speculative_decoding.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""


# Exercise 1: the greedy acceptance rule.
def my_accept_greedy(draft, choices):
    # choices[i] is what the model picks after the newest token and guesses 0..i-1, so guess i stands exactly where
    # choices[i] does. The first disagreement ends the run: every later guess followed a token that is not there.
    kept = 0
    for guess, choice in zip(draft, choices):
        if guess != choice:
            break
        kept += 1
    return kept


# Exercise 2: expected tokens per verify step.
def my_expected_tokens(a, k):
    # Guess i is kept only if guesses 1..i all were: probability a^i. The step adds the kept guesses and the model's
    # own token: 1 + a + a^2 + ... + a^k, a geometric series, (1 - a^(k+1)) / (1 - a); at a = 1 every guess is kept.
    if a == 1:
        return k + 1.0
    return (1 - a ** (k + 1)) / (1 - a)
