"""Reference solutions to lesson 15's exercises (notebooks/15_prefix_caching.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""


# Exercise 1: prefix matching by token.
def my_token_prefix(cached, token_ids):
    best = 0
    for computed in cached:  # any earlier sequence will do: take the one that agrees longest
        n = 0
        for a, b in zip(computed, token_ids):
            if a != b:  # the first difference ends it: every later key and value attended over another token
                break
            n += 1
        best = max(best, n)
    return max(min(best, len(token_ids) - 1), 0)  # the last token is always computed: its logits pick the next one


# A block lookup takes only whole blocks of the prefix it finds: if token matching finds k tokens, blocks find
# (k // 16) * 16, and lose k % 16, at most 15 (a prefix that ends one token before a block is full). It cannot be 16:
# a sixteenth token would complete the block, and the block would be found.
my_most_lost = 15


# Exercise 2: what a shared system prompt saves.
def my_saved_tokens(n_system, n_requests, block_size, together):
    if together:  # all admitted in the same step: a block gets its key once computed, and nobody has computed yet
        return 0
    # The first request finds nothing; each later one finds the system prompt's full blocks (its own question
    # starts with a token nobody else has, so the block that holds it is never found). The partial last block of the
    # system prompt is recomputed by everyone.
    return (n_requests - 1) * (n_system // block_size) * block_size


# Exercise 3: the planted mistake. Section 3's requests through planted_engine give other answers than `expected`
# for the requests that share blocks, and block_states' assert fires after the first request finishes: a block is
# held and cached at once. Section 2's walk with planted_block_manager shows where: after A finishes its full
# blocks are cached and evictable (release is right); after B's share_prefix they are held (reference count 1) and
# still evictable. share_prefix must take them out of `evictable`, or grow may evict a block someone reads.
my_diagnosis = {"method": "share_prefix"}
