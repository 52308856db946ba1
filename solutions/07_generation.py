"""Reference solutions to lesson 07's exercises (notebooks/07_generation.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch

from hardway.decode.sampling import LogitsProcessor


# Exercise 1: the log-probability of each chosen token.
def my_token_logprobs(scores, tokens):
    logprobs = scores.log_softmax(dim=-1)  # (B, n, V): normalize over the vocabulary, at each step
    return logprobs.gather(-1, tokens[..., None]).squeeze(-1)  # (B, n): the chosen token's entry


# Exercise 2: min-p, as transformers' MinPLogitsWarper.
class MyMinP(LogitsProcessor):
    def __init__(self, min_p):
        self.min_p = min_p

    def __call__(self, input_ids, scores):
        probs = scores.softmax(dim=-1)  # (B, V)
        threshold = self.min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1)
        remove = probs < threshold  # (B, V); the top token is never below min_p (<= 1) times itself
        remove = remove.scatter(1, probs.argmax(dim=-1, keepdim=True), False)  # at least one token stays
        return scores.masked_fill(remove, float("-inf"))  # (B, V)


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

