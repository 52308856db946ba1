"""Reference solutions to lesson 18's exercises (notebooks/18_speculative_decoding.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch
import torch.nn.functional as F

from hardway.instruments.distributions import chi_square_test, draw_two_tokens


# Exercise 1: which rewrite of the rejection rule keeps the distribution. Found by measurement (section 4's
# instrument), as in `diagnose_rules` below, then explained by reading the rules:
# - A keeps a guess with probability min(1, q/p): upside down, so it keeps over-proposed guesses more often.
# - B draws a rejection's token from p without the rejected guess. With q one-hot on the guess d (prompt lookup),
#   max(0, p - q) is exactly that, so B is right there; with q drawn by a model the residual must subtract all of q.
# - C judges every guess of a step with one uniform number: guess 2 is then kept with probability min(r1, r2)
#   instead of r1 * r2, the fates of the guesses tied together.
# - D compares in logs (log u < log p - log q): the same rule.
# - E writes the residual p - min(p, q): the same as max(0, p - q).
# - F judges guess i by the model's row after it, p[i + 1]: one position too late.
my_diagnosis = {"keeps": {"D", "E"}, "right_for_lookup": "B"}


def diagnose_rules(rules, tables, exact, n_runs=40_000, threshold=1e-3):
    """How the answer above is measured: {letter: (p-value with q drawn, p-value with q one-hot)} for each rule, the
    first two tokens of n_runs runs counted by draw_two_tokens and judged by chi_square_test (section 4)."""
    V = exact.shape[0]
    one_hot = dict(tables) | {name: F.one_hot(tables[name].argmax(-1), V).to(tables[name].dtype)
                              for name in ("q1", "q2", "q3")}  # prompt lookup: the guess is certain
    p_values = {}
    for letter, rule in rules.items():
        p_values[letter] = []
        for drafted in (tables, one_hot):
            pairs = draw_two_tokens(rule, drafted, n_runs, torch.Generator().manual_seed(0))  # (n_runs, 2)
            counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V)
            p_values[letter].append(chi_square_test(counts, exact)[2])
    keeps = {letter for letter, (drawn, _) in p_values.items() if drawn > threshold}
    lookup_only = {letter for letter, (drawn, one) in p_values.items() if drawn <= threshold < one}
    return p_values, keeps, lookup_only


# Exercise 2: expected tokens per verify step.
def my_expected_tokens(a, k):
    # Guess i is kept only if guesses 1..i all were: probability a^i. The step adds the kept guesses and the model's
    # own token: 1 + a + a^2 + ... + a^k, a geometric series, (1 - a^(k+1)) / (1 - a); at a = 1 every guess is kept.
    if a == 1:
        return k + 1.0
    return (1 - a ** (k + 1)) / (1 - a)
