"""Lesson 28's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_28 import check_out_proj_blocks, check_restore_value_heads


@pytest.fixture(scope="module")
def sol():
    return load_solutions("28_serving_a_state")


def test_check_restore_value_heads(sol):
    assert check_restore_value_heads(None).startswith("not attempted yet")
    assert check_restore_value_heads(sol.my_restore_value_heads).startswith("right")

    def tiled_again(rows, n_k, n_v):  # the converter's own move: (n_k, n_v / n_k, d) with the first two swapped
        d = rows.shape[0] // n_v
        return rows.reshape(n_k, n_v // n_k, d, -1).transpose(0, 1).reshape(rows.shape)

    def single_rows(rows, n_k, n_v):  # each row taken for a head
        return rows.reshape(rows.shape[0] // n_k, n_k, -1).transpose(0, 1).reshape(rows.shape)

    def heads_reversed(rows, n_k, n_v):
        d = rows.shape[0] // n_v
        return rows.reshape(n_v, d, -1).flip(0).reshape(rows.shape)

    for wrong, why in ((lambda rows, n_k, n_v: rows, "as they are"), (tiled_again, "done again, not undone"),
                       (single_rows, "as if each were a head"), (heads_reversed, "differs first"),
                       (lambda rows, n_k, n_v: rows[:-1], "has shape"),
                       (lambda rows, n_k, n_v: rows.tolist(), "should be a tensor")):
        result = check_restore_value_heads(wrong)
        assert result.startswith("wrong") and why in result, (why, result)


def test_check_out_proj_blocks(sol):
    assert check_out_proj_blocks(None).startswith("not attempted yet")
    assert check_out_proj_blocks(sol.my_out_proj_blocks).startswith("right")

    def as_tensor(*args):  # a tensor of indices is an answer too
        order = sol.my_out_proj_blocks(*args)
        return None if order is None else torch.tensor(order)
    assert check_out_proj_blocks(as_tensor).startswith("right")

    def never_none(n_k, n_v, d_v, width):  # moves blocks even where one holds two heads
        per_head, r = max(d_v // width, 1), n_v // n_k
        return [((j % r) * n_k + j // r) * per_head + b for j in range(n_v) for b in range(per_head)]

    def none_first(n_k, n_v, d_v, width):  # asks whether heads fill blocks before whether anything moved
        return None if d_v % width else sol.my_out_proj_blocks(n_k, n_v, d_v, width)

    def scattered(n_k, n_v, d_v, width):  # where each file block goes: the inverse
        order = sol.my_out_proj_blocks(n_k, n_v, d_v, width)
        return order if order is None else [order.index(i) for i in range(len(order))]

    def per_column(n_k, n_v, d_v, width):
        order = sol.my_out_proj_blocks(n_k, n_v, d_v, 1)
        return None if d_v % width else order

    def per_head(n_k, n_v, d_v, width):
        return None if d_v % width else sol.my_out_proj_blocks(n_k, n_v, width, width)

    def identity(n_k, n_v, d_v, width):
        return None if d_v % width and n_k not in (1, n_v) else list(range(n_v * d_v // width))

    def never_moves(n_k, n_v, d_v, width):  # None for every tiled out_proj
        return list(range(n_v * d_v // width)) if n_k in (1, n_v) else None

    for wrong, why in ((never_none, "return None"), (none_first, "moved nothing"), (scattered, "inverse permutation"),
                       (per_column, "one entry per column"), (per_head, "one entry per value head"),
                       (identity, "the identity"), (never_moves, "move as blocks"),
                       (lambda *a: "0 1", "expected a list of block indices")):
        result = check_out_proj_blocks(wrong)
        assert result.startswith("wrong") and why in result, (why, result)
