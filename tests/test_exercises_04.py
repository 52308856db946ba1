"""Lesson 04's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import math

import torch

from hardway.exercises.lesson_04 import check_attention, check_sliding_window_mask, check_split_heads
from hardway.models.gpt2 import causal_mask
from exercise_solutions import load_solutions



def _solutions():
    return load_solutions("04_attention")


def test_check_attention():
    solution = _solutions().my_attention
    assert check_attention(None).startswith("not attempted yet")
    assert check_attention(solution).startswith("right")

    def no_scale(q, k, v, mask):
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf")), -1) @ v

    def mask_inverted(q, k, v, mask):  # -inf where the query MAY look
        return solution(q, k, v, ~mask | torch.eye(*mask.shape[-2:], dtype=torch.bool))

    def softmax_over_queries(q, k, v, mask):
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, -1e9)
        return torch.softmax(scores, dim=-2) @ v

    def always_causal(q, k, v, mask):  # ignores the mask it is given
        return solution(q, k, v, causal_mask(q.shape[2], k.shape[2]))

    for wrong in (no_scale, mask_inverted, softmax_over_queries):
        assert check_attention(wrong).startswith("wrong: the output for q (1, 1, 4, 8)"), wrong.__name__
    assert "random mask" in check_attention(always_causal)


def test_check_sliding_window_mask():
    solution = _solutions().my_sliding_window_mask
    assert check_sliding_window_mask(None).startswith("not attempted yet")
    assert check_sliding_window_mask(solution).startswith("right")

    def one_too_many(T, S, window):  # sees `window` keys before itself, window + 1 in all
        return solution(T, S, window + 1)

    def queries_from_zero(T, S, window):  # forgets that the queries are the last T positions
        q, kpos = torch.arange(T)[:, None], torch.arange(S)[None, :]
        return (kpos <= q) & (kpos > q - window)

    def not_causal(T, S, window):
        q, kpos = (S - T + torch.arange(T))[:, None], torch.arange(S)[None, :]
        return (kpos - q).abs() < window

    for wrong in (one_too_many, not_causal):
        assert check_sliding_window_mask(wrong).startswith("wrong: the mask for T=6, S=6, window=3"), wrong.__name__
    assert check_sliding_window_mask(queries_from_zero).startswith("wrong: the mask for T=1, S=10, window=4")


def test_check_split_heads():
    import json

    from hardway.models.gpt2 import GPT2Config
    from hardway.formats.hub import checkpoint
    from hardway.formats.safetensors import load_file

    folder = checkpoint("openai-community/gpt2")
    config = GPT2Config.from_dict(json.loads((folder / "config.json").read_text()))
    tensors = load_file(folder / "model.safetensors")
    solution = _solutions().my_split_heads
    assert check_split_heads(None, tensors, config).startswith("not attempted yet")
    assert check_split_heads(solution, tensors, config).startswith("right")

    def heads_last(w, b, x, n_head):  # cuts C as (d, H) instead of (H, d)
        B, T, C = x.shape
        q, k, v = (x @ w + b).split(C, dim=-1)
        return tuple(t.view(B, T, C // n_head, n_head).permute(0, 3, 1, 2) for t in (q, k, v))

    def interleaved_qkv(w, b, x, n_head):  # reads q, k, v as every third column
        B, T, C = x.shape
        qkv = (x @ w + b).view(B, T, C, 3)
        return tuple(qkv[..., i].view(B, T, n_head, C // n_head).transpose(1, 2) for i in range(3))

    def no_bias(w, b, x, n_head):
        return solution(w, torch.zeros_like(b), x, n_head)

    def heads_not_moved_forward(w, b, x, n_head):  # (B, T, H, d)
        return tuple(t.transpose(1, 2) for t in solution(w, b, x, n_head))

    for wrong in (heads_last, interleaved_qkv, no_bias):
        assert check_split_heads(wrong, tensors, config).startswith("wrong: q differs first at index"), wrong.__name__
    assert "has shape (2, 5, 12, 64), expected (2, 12, 5, 64)" in check_split_heads(heads_not_moved_forward, tensors, config)
