"""Reference solutions to lesson 07's exercises (notebooks/07_generation.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import math

import torch

from hardway.decode.sampling import LogitsProcessor


# Exercise 1: the log-probability of each chosen token.
def my_token_logprobs(scores, tokens):
    logprobs = scores.log_softmax(dim=-1)  # (B, n, V): normalize over the vocabulary, at each step
    return logprobs.gather(-1, tokens[..., None]).squeeze(-1)  # (B, n): the chosen token's entry


# Exercise 2: min-p in logit space. p_i >= min_p * p_max  <=>  exp(z_i / T) >= min_p * exp(z_max / T) (the softmax's
# normalizer cancels)  <=>  z_i >= z_max + T * ln(min_p). Temperature first scales the cut: a higher T lowers it (ln(min_p)
# < 0), so more tokens survive at the same min_p.
def my_min_p_survivors(scores, min_p, temperature):
    cutoff = scores.amax(dim=-1, keepdim=True) + temperature * math.log(min_p)  # (B, 1)
    return (scores >= cutoff).sum(dim=-1).tolist()  # (B,) counts


# Exercise 3: no repeated n-grams, as transformers' NoRepeatNGramLogitsProcessor.
class MyNoRepeatNGram(LogitsProcessor):
    def __init__(self, ngram_size):
        self.n = ngram_size

    def __call__(self, input_ids, scores):
        B, T = input_ids.shape
        banned = torch.zeros_like(scores, dtype=torch.bool)  # (B, V)
        if T < self.n:
            return scores
        for b in range(B):
            ids = input_ids[b].tolist()
            prefix = ids[T - self.n + 1:] if self.n > 1 else []  # the last n - 1 tokens
            for start in range(T - self.n + 1):  # every complete n-gram ids[start:start + n]
                if ids[start:start + self.n - 1] == prefix:
                    banned[b, ids[start + self.n - 1]] = True
        return scores.masked_fill(banned, float("-inf"))  # (B, V)

