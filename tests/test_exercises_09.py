"""Lesson 09's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""


import pytest
import torch

from hardway.exercises.lesson_09 import (check_half_split_to_interleaved_rows, check_interleaved_rope, check_parameter_count,
                               check_repeat_kv)
from hardway.models.llama import apply_rope, apply_rope_interleaved, interleave_permutation
from exercise_solutions import load_solutions



@pytest.fixture(scope="module")
def solutions():
    return load_solutions("09_llama")


def _not_implemented(*args):
    raise NotImplementedError


def test_check_interleaved_rope(solutions):
    assert check_interleaved_rope(None).startswith("not attempted yet")
    assert check_interleaved_rope(_not_implemented).startswith("not attempted yet")
    assert check_interleaved_rope(solutions.my_rope_interleaved).startswith("right")
    assert check_interleaved_rope(apply_rope_interleaved).startswith("right")  # the lesson's own

    def every_other_angle(x, cos, sin):  # reads pair i's angle from column 2i, as if cos were interleaved too
        return solutions.my_rope_interleaved(x, cos[..., 0::2].repeat(1, 2), sin[..., 0::2].repeat(1, 2))

    def backwards(x, cos, sin):  # rotates the other way: the sign of sin flipped
        return solutions.my_rope_interleaved(x, cos, -sin)

    for wrong in (apply_rope, every_other_angle, backwards, lambda x, cos, sin: x):  # half-split pairing, ...
        verdict = check_interleaved_rope(wrong)
        assert verdict.startswith("wrong: the rotated x differs first at index"), verdict
    assert "shape" in check_interleaved_rope(lambda x, cos, sin: x[..., :-1])


def test_check_half_split_to_interleaved_rows(solutions):
    check = check_half_split_to_interleaved_rows
    assert check(None).startswith("not attempted yet")
    assert check(solutions.my_half_split_to_interleaved_rows).startswith("right")

    def other_direction(w, n_heads):  # the permutation that goes from interleaved to half-split: the inverse
        d = w.shape[0] // n_heads
        return w.view(n_heads, d, -1)[:, interleave_permutation(d)].reshape(w.shape)

    def across_heads(w, n_heads):  # permutes all rows as one head of n_heads * d dimensions
        return solutions.my_half_split_to_interleaved_rows(w, 1)

    def pairs_swapped(w, n_heads):  # (i + d/2, i) instead of (i, i + d/2): each pair rotates the wrong way
        d = w.shape[0] // n_heads
        half = torch.arange(d // 2)
        order = torch.stack((half + d // 2, half), dim=1).flatten()
        return w.view(n_heads, d, -1)[:, order].reshape(w.shape)

    for wrong in (lambda w, n: w, other_direction, across_heads, pairs_swapped):
        verdict = check(wrong)
        assert verdict.startswith("wrong: the score tensor"), verdict
    assert "shape" in check(lambda w, n: w.T)


def test_check_repeat_kv(solutions):
    assert check_repeat_kv(None).startswith("not attempted yet")
    assert check_repeat_kv(solutions.my_repeat_kv).startswith("right")
    verdict = check_repeat_kv(lambda x, n_rep: x.repeat(1, n_rep, 1, 1))  # tiles [a, b, c, a, b, c]
    assert verdict.startswith("wrong: my_repeat_kv(x, n_rep=2) differs first at index"), verdict
    assert "shape" in check_repeat_kv(lambda x, n_rep: x.repeat_interleave(n_rep, dim=2))  # the wrong dim
    assert check_repeat_kv(lambda x, n_rep: 1 / 0).startswith("wrong: my_repeat_kv raised ZeroDivisionError")


def test_check_parameter_count(solutions):
    assert check_parameter_count(None).startswith("not attempted yet")
    assert check_parameter_count(solutions.my_parameter_count).startswith("right")

    def head_counted_twice(config):
        return solutions.my_parameter_count({**config, "tie_word_embeddings": False})

    def multi_head_kv(config):  # as many K/V heads as query heads
        return solutions.my_parameter_count({**config, "num_key_value_heads": config["num_attention_heads"]})

    def ignores_head_dim(config):
        return solutions.my_parameter_count({k: v for k, v in config.items() if k != "head_dim"})

    def no_biases(config):
        return solutions.my_parameter_count({**config, "attention_bias": False, "mlp_bias": False})

    assert check_parameter_count(head_counted_twice).startswith("wrong: Llama 3.2 1B")
    assert check_parameter_count(multi_head_kv).startswith("wrong: Llama 3.2 1B")
    assert check_parameter_count(ignores_head_dim).startswith("wrong: tiny")
    assert check_parameter_count(no_biases).startswith("wrong: tiny")
    assert "expected the int" in check_parameter_count(lambda config: "a lot")
