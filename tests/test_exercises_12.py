"""Lesson 12's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""


import pytest

import hardway
from hardway.exercises.lesson_12 import check_recompile_predictions, check_roofline
from exercise_solutions import load_solutions



def _solutions():
    return load_solutions("12_fast_decode")


@pytest.fixture(scope="module")
def gpt2():
    return hardway.load("openai-community/gpt2")


def test_check_roofline(gpt2):
    solution = _solutions().my_roofline_tokens_per_s
    assert check_roofline(None, gpt2).startswith("not attempted yet")
    assert check_roofline(solution, gpt2).startswith("right")

    def weights_only(model, bandwidth, context_len):
        return solution(model, bandwidth, 0)

    def head_counted_twice(model, bandwidth, context_len):  # GPT-2's tied head read as a second matrix
        extra = model.wte.weight.nbytes if hasattr(model, "wte") else 0
        return bandwidth / (bandwidth / solution(model, bandwidth, context_len) + extra)

    def whole_cache(model, bandwidth, context_len):  # reads all max_seq_len positions whatever the context
        return solution(model, bandwidth, model.max_seq_len)

    def keys_only(model, bandwidth, context_len):
        per_position = model.new_kv_cache(1, 1).nbytes // 2
        return bandwidth / (bandwidth / solution(model, bandwidth, 0) + context_len * per_position)

    def query_heads_cached(model, bandwidth, context_len):  # grouped-query attention ignored: a cache of every head
        cache = model.new_kv_cache(1, 1)
        per_position = cache.nbytes * getattr(model.config, "num_attention_heads", cache.n_kv_heads) // cache.n_kv_heads
        return bandwidth / (bandwidth / solution(model, bandwidth, 0) + context_len * per_position)

    for wrong, start, term in (
            (weights_only, "wrong: this lesson's model at 20 GB/s and 512 cached", "the cache"),
            (head_counted_twice, "wrong: this lesson's model at 20 GB/s and 0 cached", "a tied head counted twice"),
            (whole_cache, "wrong: this lesson's model at 20 GB/s and 0 cached", "the context length"),
            (keys_only, "wrong: this lesson's model at 20 GB/s and 512 cached", "the keys alone"),
            (query_heads_cached, "wrong: a small Llama with GQA at 20 GB/s and 512 cached", "the query heads")):
        verdict = check_roofline(wrong, gpt2)
        assert verdict.startswith(start) and f"look again at {term}" in verdict, (wrong.__name__, verdict)


def test_check_recompile_predictions():
    solution = _solutions().my_predictions
    assert check_recompile_predictions(None).startswith("not attempted yet: set my_predictions to your dict")
    assert check_recompile_predictions(solution).startswith("right")

    everything_one_graph = {name: (1, False) for name in solution}  # "compiled means one graph"
    verdict = check_recompile_predictions(everything_one_graph)
    assert verdict.startswith("wrong: int_slice") and "the number of graphs is not" in verdict
    assert "3" not in verdict.split("did.")[1]  # the hint, not the measured count

    no_read_back = {**solution, "item_slice": (1, False)}  # "the tensor is passed, so nothing is read back"
    verdict = check_recompile_predictions(no_read_back)
    assert verdict.startswith("wrong: item_slice") and "whether it reads the position back" in verdict

    shapes_ignored = {**solution, "index_copy_after_prefill": (1, False)}  # forgets that shapes are guarded too
    assert check_recompile_predictions(shapes_ignored).startswith("wrong: index_copy_after_prefill")

    assert check_recompile_predictions({"int_slice": (3, False)}).startswith("wrong: give a dict with one prediction")
    assert check_recompile_predictions({**solution, "where_row": 1}).startswith("wrong: where_row: predict a pair")
