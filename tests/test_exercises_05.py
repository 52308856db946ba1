"""Lesson 05's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""


import pytest
import torch
import torch.nn.functional as F

from hardway.exercises.lesson_05 import check_gelu_new, check_post_norm_block
from hardway.models.gpt2 import Block, GPT2Config
from exercise_solutions import load_solutions



def _solutions():
    return load_solutions("05_transformer_block")


def test_check_gelu_new():
    assert check_gelu_new(None).startswith("not attempted yet")
    assert check_gelu_new(_solutions().my_gelu_new).startswith("right")
    builtin = check_gelu_new(lambda x: F.gelu(x, approximate="tanh"))  # the same formula, other rounding
    assert builtin.startswith("wrong: gelu on torch.float32 differs first at index") and "bit for bit" in builtin
    assert check_gelu_new(F.gelu).startswith("wrong: gelu on torch.float32")  # the exact GELU
    assert check_gelu_new(lambda x: x * torch.sigmoid(1.702 * x)).startswith("wrong:")  # the sigmoid approximation
    assert "keep the input's dtype" in check_gelu_new(lambda x: _solutions().my_gelu_new(x.float()))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    b = Block(GPT2Config(n_embd=64, n_head=4), layer_idx=0).eval()
    with torch.no_grad():
        for p in b.parameters():  # LayerNorm's default ones/zeros would hide a swapped ln_1/ln_2
            p.add_(torch.randn_like(p) * 0.2)
    return b


def test_check_post_norm_block(block):
    solution = _solutions().my_post_norm_block
    assert check_post_norm_block(None, block).startswith("not attempted yet")
    assert check_post_norm_block(solution, block).startswith("right")

    def pre_norm(block, x):  # GPT-2's own order
        return block(x)

    def norms_swapped(block, x):
        h = block.ln_2(x + block.attn(x))
        return block.ln_1(h + block.mlp(h))

    def no_residual(block, x):
        h = block.ln_1(block.attn(x))
        return block.ln_2(block.mlp(h))

    for wrong in (pre_norm, norms_swapped, no_residual):
        assert check_post_norm_block(wrong, block).startswith("wrong: the post-norm block's output differs"), wrong.__name__
