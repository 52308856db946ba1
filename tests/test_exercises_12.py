"""Lesson 12's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""


import pytest

import hardway
from hardway.exercises import check_roofline, check_static_update
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

    assert check_roofline(weights_only, gpt2).startswith("wrong: this lesson's model at 20 GB/s and 512 cached")
    assert check_roofline(head_counted_twice, gpt2).startswith("wrong: this lesson's model at 20 GB/s and 0 cached")
    assert check_roofline(whole_cache, gpt2).startswith("wrong: this lesson's model at 20 GB/s and 0 cached")
    assert check_roofline(keys_only, gpt2).startswith("wrong: this lesson's model at 20 GB/s and 512 cached")


def test_check_static_update():
    solution = _solutions().my_static_update
    assert check_static_update(None).startswith("not attempted yet")
    assert check_static_update(solution).startswith("right")

    def written_prefix(k_cache, v_cache, start_pos, k, v):  # returns only the slots written so far
        solution(k_cache, v_cache, start_pos, k, v)
        end = start_pos + k.shape[2]
        return k_cache[:, :, :end], v_cache[:, :, :end]

    def off_by_one(k_cache, v_cache, start_pos, k, v):
        return solution(k_cache, v_cache, start_pos + 1, k, v)

    def not_in_place(k_cache, v_cache, start_pos, k, v):
        return solution(k_cache.clone(), v_cache.clone(), start_pos, k, v)

    def sliced(k_cache, v_cache, start_pos, k, v):  # right values eagerly; a slice by a tensor value in a graph
        p = int(start_pos)
        k_cache[:, :, p:p + k.shape[2]] = k
        v_cache[:, :, p:p + v.shape[2]] = v
        return k_cache, v_cache

    assert "has shape (2, 3, 3, 4), expected (2, 3, 10, 4)" in check_static_update(written_prefix)
    assert check_static_update(off_by_one).startswith("wrong: the returned keys at start_pos=0")
    assert "write in place" in check_static_update(not_in_place)
    assert "reads the position back to the host" in check_static_update(sliced)
