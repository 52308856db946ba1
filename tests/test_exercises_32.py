"""Lesson 32's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import math

import pytest

from exercise_solutions import load_solutions
from hardway.exercises.lesson_32 import check_cache_crossover, check_latent_bytes, check_windowed_bytes


@pytest.fixture(scope="module")
def sol():
    return load_solutions("32_cache_bytes")


def test_check_windowed_bytes(sol):
    assert check_windowed_bytes(None).startswith("not attempted yet")
    assert check_windowed_bytes(sol.my_windowed_bytes).startswith("right")

    def per_position(L, H, d):
        return L * 2 * H * d * 2

    def exact_window(L, H, d, w, n):
        return min(n, w) * per_position(L, H, d)

    def every_position(L, H, d, w, n):
        return math.ceil(n / 16) * 16 * per_position(L, H, d)

    def keys_only(L, H, d, w, n):
        return sol.my_windowed_bytes(L, H, d, w, n) // 2

    def fp32(L, H, d, w, n):
        return sol.my_windowed_bytes(L, H, d, w, n) * 2

    def window_blocks_rounded_up(L, H, d, w, n):  # ceil(min(n, w) / 16) blocks: misses the part-block at each end
        return math.ceil(min(n, w) / 16) * 16 * per_position(L, H, d)

    for wrong, why in ((exact_window, "window's positions exactly"), (every_position, "go back to the pool"),
                       (keys_only, "a key and a value"), (fp32, "2 bytes"), (window_blocks_rounded_up, "expected")):
        result = check_windowed_bytes(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)


def test_check_latent_bytes(sol):
    assert check_latent_bytes(None).startswith("not attempted yet")
    assert check_latent_bytes(sol.my_latent_bytes).startswith("right")

    def pair(latent, per_head):
        def answer(c):
            return latent(c), per_head(c)
        return answer

    def right_per_head(c):
        return sol.my_latent_bytes(c)[1]

    L, H = (lambda c: c["num_hidden_layers"]), (lambda c: c["num_attention_heads"])
    latent_twice = pair(lambda c: L(c) * 2 * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2, right_per_head)
    no_rope = pair(lambda c: L(c) * c["kv_lora_rank"] * 2, right_per_head)
    rope_per_head = pair(lambda c: L(c) * (c["kv_lora_rank"] + H(c) * c["qk_rope_head_dim"]) * 2, right_per_head)
    keys_without_rope = pair(lambda c: sol.my_latent_bytes(c)[0],
                             lambda c: L(c) * H(c) * (c["qk_nope_head_dim"] + c["v_head_dim"]) * 2)
    for wrong, why in ((latent_twice, "kept once"), (no_rope, "rotation depends on the position"),
                       (rope_per_head, "every head"), (keys_without_rope, "nope part and the rope part"),
                       (lambda c: 70272, "return a pair")):
        result = check_latent_bytes(wrong)
        assert result.startswith("wrong") and why in result, (result,)


def test_check_cache_crossover(sol):
    assert check_cache_crossover(None).startswith("not attempted yet")
    assert check_cache_crossover(sol.my_cache_crossover).startswith("right")

    def ignores_batch(n_params, cost, batch):
        return sol.my_cache_crossover(n_params, cost, 1)

    def fp32_weights(n_params, cost, batch):
        return sol.my_cache_crossover(2 * n_params, cost, batch)

    def window_ignored(n_params, cost, batch):  # every position counted as if the cache kept growing
        per_position = (cost.full_block_bytes + cost.sliding_block_bytes) / cost.block_size
        return math.ceil(2 * n_params / (batch * per_position))

    def weights_times_batch(n_params, cost, batch):
        return sol.my_cache_crossover(n_params * batch, cost, batch)

    for wrong, why in ((ignores_batch, "read once for all of them"), (fp32_weights, "fp32"),
                       (window_ignored, "no length gets there"), (weights_times_batch, "expected")):
        result = check_cache_crossover(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)
