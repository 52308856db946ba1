"""Reference solutions to lesson 13's exercises (notebooks/13_batching_and_chat.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""

import torch

from hardway.text.chat import ChatTemplateError

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
