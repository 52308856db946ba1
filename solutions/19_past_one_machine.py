"""Reference solutions to lesson 19's exercises (notebooks/19_past_one_machine.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import torch

from hardway.tensor_parallel import attention_partial, mlp_partial


# Exercise 1: greedy without gathering the logits.
def my_greedy_pick(logits, vocab_start, all_gather):
    # Each rank's best logit and the id it belongs to (torch.max takes the first of equal values: the lowest id).
    best, where = logits.max(dim=-1)  # (rows,), (rows,)
    ids = (where + vocab_start).to(best.dtype)  # (rows,): fp32 holds every id below 2**24 exactly
    gathered = torch.stack(all_gather(torch.stack([best, ids], dim=-1)))  # (world, rows, 2): 2 values a row each
    # The rank with the largest best; argmax takes the first on a tie, and lower ranks hold lower ids, so the
    # lowest tied id wins, as one process's argmax over the whole vocabulary would pick.
    rank = gathered[..., 0].argmax(dim=0)  # (rows,)
    return gathered[rank, torch.arange(rank.shape[0]), 1].long()  # (rows,)


# Exercise 2: the planted mistakes, found with diagnose below, then written down.
my_diagnosis = [{"layer": 3, "half": "mlp", "fault": "bias"}, {"layer": 8, "half": "attention", "fault": "heads"}]


def diagnose(model, ranks, input_ids, tol=1e-4):
    """Every block on the whole model's own input to it: each half's partial sums over the ranks against the whole
    half. Where they differ, a difference that is the same vector at every position is a bias counted twice; one
    that changes from token to token is the rows (heads in the attention, hidden units in the MLP)."""
    found = []
    with torch.no_grad():
        x = model.embed(input_ids)  # (1, T, C)
        for layer, block in enumerate(model.h):
            for half, norm, whole, partial in (("attention", block.ln_1, block.attn, attention_partial),
                                               ("mlp", block.ln_2, block.mlp, mlp_partial)):
                h = norm(x)  # (1, T, C)
                diff = sum(partial(r.blocks[layer], h) for r in ranks) - whole(h)  # (1, T, C)
                if diff.abs().max() > tol:
                    same_everywhere = (diff - diff[:, :1]).abs().max() < tol
                    rows = "heads" if half == "attention" else "units"
                    found.append({"layer": layer, "half": half, "fault": "bias" if same_everywhere else rows})
            x = block(x)  # the whole model's stream: the next block's input, free of the mistakes before it
    return found


# Exercise 3: the bytes of weights one rank holds, which is what it reads to decode a token (all but the position
# table's other rows).
def my_rank_bytes(config, rank, world):
    C, L, D = config.n_embd, config.n_layer, config.d_mlp
    v_pad = -(-config.vocab_size // 64) * 64  # padded to a multiple of 64, then split: zero rows count too
    vocab = v_pad // world * C  # the tied table is also the head: once
    whole = config.n_positions * C + (2 * L + 1) * 2 * C  # the position table and every norm, on every rank
    split = L * (4 * C * C + 2 * D * C + 3 * C + D) // world  # c_attn, attn.c_proj, c_fc, mlp.c_proj, and the
    # column-parallel biases (c_attn's, c_fc's), which go with their rows
    row_biases = 2 * L * C if rank == 0 else 0  # the c_proj biases: rank 0 alone, so the all-reduce adds them once
    return 4 * (vocab + whole + split + row_biases)
