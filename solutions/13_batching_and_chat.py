"""Reference solutions to lesson 13's exercises (notebooks/13_batching_and_chat.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch


SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


# Exercise 1: SmolLM2's ChatML template, in plain Python.
def my_chatml(messages, add_generation_prompt):
    parts = []
    if messages and messages[0]["role"] != "system":
        parts.append(f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


# Exercise 2: the FLOPs of a left-padded prefill. Every row runs max(lengths) columns, padding included; at each
# column every matrix product costs 2 FLOPs a multiply-add: q and o (n_heads head_dim wide), k and v (the KV heads'),
# the MLP's three matrices and the head. Attention adds two products per query head over the whole (T, T) square,
# scores q k^T and their weighted sum of v: a mask hides scores, it does not skip them.
def my_prefill_flops(config, lengths):
    B, T = len(lengths), max(lengths)
    C, d, I, V = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    H, KV, L = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    per_column = L * (2 * H * d * C + 2 * KV * d * C + 3 * C * I) + C * V  # multiply-adds
    attention = L * H * 2 * T * T * d  # multiply-adds, per row
    return 2 * B * (T * per_column + attention)


# Exercise 3: prompts packed end to end in one row.
def my_pack(lengths):
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # (N,): which prompt
    positions = torch.cat([torch.arange(n) for n in lengths])  # (N,): each prompt counts from 0 again
    N = len(segment)
    causal = torch.ones(N, N, dtype=torch.bool).tril()  # (N, N): key j <= query i
    return positions, causal & (segment[:, None] == segment[None, :])  # and the same prompt: block-diagonal


# Exercise 4: next-token logits of a right-padded batch. The filler comes after every real token, so the causal mask
# already hides it from them, and their positions are their columns: no mask is needed, only the right column.
def my_right_padded_next_logits(model, input_ids, attention_mask):
    logits = model(input_ids)  # (B, T, V)
    last = attention_mask.sum(dim=1) - 1  # (B,): each row's last real token
    return logits[torch.arange(len(last)), last]  # (B, V)
