"""Lesson 03's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""


import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Model

from hardway.exercises.lesson_03 import check_embed, check_sinusoidal
from hardway.formats.hub import checkpoint
from exercise_solutions import load_solutions



def _solutions():
    return load_solutions("03_embeddings")


@pytest.fixture(scope="module")
def reference():
    return GPT2Model.from_pretrained(checkpoint("openai-community/gpt2"), dtype=torch.float32).eval()


def test_check_embed(reference):
    solution = _solutions().my_embed
    assert check_embed(None, reference).startswith("not attempted yet")
    verdict = check_embed(solution, reference)
    assert verdict.startswith("right") and "one-hot" in verdict

    def positions_from_zero(wte, wpe, ids, start_pos):  # forgets start_pos
        return solution(wte, wpe, ids, 0)

    def off_by_one(wte, wpe, ids, start_pos):  # positions start_pos + 1 ..
        return F.one_hot(ids, wte.shape[0]).float() @ wte + wpe[start_pos + 1 + torch.arange(ids.shape[1])]

    def no_positions(wte, wpe, ids, start_pos):
        return F.one_hot(ids, wte.shape[0]).float() @ wte

    def indexed(wte, wpe, ids, start_pos):  # right values, but a lookup: passes, with a note
        return wte[ids] + wpe[start_pos:start_pos + ids.shape[1]]

    def not_yet(wte, wpe, ids, start_pos):
        raise NotImplementedError

    assert "start_pos=5" in check_embed(positions_from_zero, reference)
    assert check_embed(off_by_one, reference).startswith("wrong:")
    assert check_embed(no_positions, reference).startswith("wrong: x at start_pos=0 differs first at index")
    assert "indexes the table" in check_embed(indexed, reference)
    assert check_embed(not_yet, reference).startswith("not attempted yet")


def test_check_sinusoidal():
    solution = _solutions().my_sinusoidal
    assert check_sinusoidal(None).startswith("not attempted yet")
    assert check_sinusoidal(solution).startswith("right")

    def sin_cos_swapped(n_pos, dim):
        return solution(n_pos, dim)[:, [j + 1 if j % 2 == 0 else j - 1 for j in range(dim)]]

    def exponent_j_over_dim(n_pos, dim):  # 10000^(j/dim) with j the column instead of 2i
        p = torch.arange(n_pos)[:, None].double()
        j = torch.arange(dim)[None, :].double()
        angle = p / 10000 ** (j / dim)
        return torch.where(j % 2 == 0, torch.sin(angle), torch.cos(angle)).float()

    def half_split(n_pos, dim):  # sin in the first half, cos in the second (another common layout)
        t = solution(n_pos, dim)
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)

    def transposed(n_pos, dim):
        return solution(n_pos, dim).T

    for wrong in (sin_cos_swapped, exponent_j_over_dim, half_split):
        assert check_sinusoidal(wrong).startswith("wrong: the (16, 8) table differs first at index"), wrong.__name__
    assert "has shape (8, 16), expected (16, 8)" in check_sinusoidal(transposed)
