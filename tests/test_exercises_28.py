"""Lesson 28's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_28 import check_engine_cache_bytes, check_out_proj_blocks, check_restore_value_heads


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


def test_check_engine_cache_bytes(sol):
    assert check_engine_cache_bytes(None).startswith("not attempted yet")
    result = check_engine_cache_bytes(sol.my_engine_cache_bytes)
    assert result.startswith("right") and "GiB" in result, result

    def pieces(config):  # the sizes, written here from the config as a learner would (Qwen3.5's defaults)
        n = config["num_hidden_layers"]
        types = config.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "x" for i in range(n)]
        g = lambda key, default: config.get(key, default)  # noqa: E731
        return (n, types.count("full_attention"), g("num_key_value_heads", 4) * g("head_dim", 256),
                g("linear_num_key_heads", 16), g("linear_num_value_heads", 32), g("linear_key_head_dim", 128),
                g("linear_value_head_dim", 128))

    def made(state_bytes=4, every_layer=False, slots=None, conv_k=-1, conv_v_only=False, key_heads=False):
        def my_engine_cache_bytes(config, n_blocks, block_size, max_batch, value_bytes):
            n, n_att, kv, h_k, h_v, d_k, d_v = pieces(config)
            pool = 2 * (n if every_layer else n_att) * n_blocks * block_size * kv * value_bytes
            conv = (h_v * d_v if conv_v_only else 2 * h_k * d_k + h_v * d_v) * (4 + conv_k)
            slot = (n - n_att) * (conv + (h_k if key_heads else h_v) * d_k * d_v) * state_bytes
            return pool + (max_batch if slots is None else slots) * slot
        return my_engine_cache_bytes

    assert check_engine_cache_bytes(made()).startswith("right")  # the same formula, written another way
    for wrong, why in ((made(state_bytes=2), "fp32 whatever the model's dtype"),
                       (made(every_layer=True), "only the full-attention layers"),
                       (made(slots=1), "max_batch of them"), (made(slots=0), "slots are missing"),
                       (made(conv_k=0), "K - 1 inputs"), (made(conv_v_only=True), "q, k and v together"),
                       (made(key_heads=True), "per value head"),
                       (lambda *args: "2.6 GB", "a positive number of bytes")):
        result = check_engine_cache_bytes(wrong)
        assert result.startswith("wrong") and why in result, result
