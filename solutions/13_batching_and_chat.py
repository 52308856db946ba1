"""Reference solutions to lesson 13's exercises (notebooks/13_batching_and_chat.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch

from hardway.chat import ChatTemplateError

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


# Exercise 2: keep a conversation within `max_tokens`, dropping the oldest exchanges first.
def my_fit_conversation(chat, messages, max_tokens):
    head = messages[:1] if messages[0]["role"] == "system" and len(messages) > 1 else []
    rest = messages[len(head):]
    while True:
        kept = head + rest
        n = len(chat.encode(kept, add_generation_prompt=True))
        if n <= max_tokens:
            return kept
        if len(rest) == 1:  # only the last message is left besides the system message
            raise ChatTemplateError(f"the system message and the last message alone need {n} tokens, "
                                    f"more than max_tokens={max_tokens}")
        rest = rest[1:]  # drop the oldest message, and the answers after it: keep starting at a question
        while len(rest) > 1 and rest[0]["role"] != "user":
            rest = rest[1:]


# Exercise 3: left padding by hand.
def my_left_pad(token_lists, pad_id):
    T = max(len(ids) for ids in token_lists)
    input_ids = torch.tensor([[pad_id] * (T - len(ids)) + list(ids) for ids in token_lists])  # (B, T)
    attention_mask = torch.tensor([[0] * (T - len(ids)) + [1] * len(ids) for ids in token_lists])  # (B, T)
    return input_ids, attention_mask


# Exercise 4: positions and mask of a left-padded batch.
def my_positions_and_mask(attention_mask):
    real = attention_mask.bool()  # (B, S)
    positions = (real.long().cumsum(-1) - 1).masked_fill(~real, 0)  # (B, S)
    S = attention_mask.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool).tril()  # (S, S): key j <= query i
    return positions, causal & real[:, None, None, :]  # (B, 1, S, S)
