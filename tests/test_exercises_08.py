"""Lesson 08's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""


import pytest
import torch

from hardway.exercises.lesson_08 import (KV_CONFIGS, check_kv_bytes_per_token, check_positions_processed,
                               check_sliding_window_cache)
from hardway.models.kv_cache import KVCache, kv_cache_bytes_per_token
from exercise_solutions import load_solutions



@pytest.fixture(scope="module")
def solutions():
    return load_solutions("08_kv_cache")


def test_check_positions_processed(solutions):
    assert check_positions_processed(None).startswith("not attempted yet")
    assert check_positions_processed(solutions.my_positions_processed).startswith("right")

    def one_pass_too_many(prompt_len, max_new_tokens, use_cache):  # a forward pass after the last token
        return solutions.my_positions_processed(prompt_len, max_new_tokens + 1, use_cache)

    def naive_reruns_only_new(prompt_len, max_new_tokens, use_cache):  # as if the naive loop had a cache
        return solutions.my_positions_processed(prompt_len, max_new_tokens, True)

    for wrong in (one_pass_too_many, naive_reruns_only_new):
        assert check_positions_processed(wrong).startswith("wrong: prompt_len=32, max_new_tokens=128"), wrong


def test_check_kv_bytes_per_token(solutions):
    assert check_kv_bytes_per_token(None).startswith("not attempted yet")
    assert check_kv_bytes_per_token(solutions.my_kv_bytes_per_token).startswith("right")

    def no_factor_two(config, b):  # keys only, no values
        return solutions.my_kv_bytes_per_token(config, b) // 2

    def query_heads(config, b):  # multi-head attention's cache for a GQA model
        return solutions.my_kv_bytes_per_token({**config, "num_key_value_heads": config["num_attention_heads"]}, b)

    def ignores_head_dim(config, b):
        return solutions.my_kv_bytes_per_token({k: v for k, v in config.items() if k != "head_dim"}, b)

    assert check_kv_bytes_per_token(no_factor_two).startswith("wrong: Llama 3 8B at 2 bytes")
    assert check_kv_bytes_per_token(query_heads).startswith("wrong: Llama 3 8B at 2 bytes")
    assert "(4x the right answer)" in check_kv_bytes_per_token(query_heads)
    assert check_kv_bytes_per_token(ignores_head_dim).startswith("wrong: head_dim not hidden/heads")
    assert check_kv_bytes_per_token(lambda config, b: (_ for _ in ()).throw(KeyError("num_key_value_heads"))
                                    ).startswith("wrong: my_kv_bytes_per_token raised KeyError")


def test_the_formula_agrees_with_the_published_numbers():
    assert kv_cache_bytes_per_token(32, 8, 128, torch.bfloat16) == 131_072  # Llama 3 8B, GQA
    assert kv_cache_bytes_per_token(32, 32, 128, torch.bfloat16) == 524_288  # the same with full MHA
    c = KV_CONFIGS["Llama 3 70B"]
    assert kv_cache_bytes_per_token(80, 8, 128, torch.bfloat16) * 8 == kv_cache_bytes_per_token(80, 64, 128,
                                                                                                 torch.bfloat16)
    assert c["hidden_size"] // c["num_attention_heads"] == 128


def test_check_sliding_window_cache(solutions):
    assert check_sliding_window_cache(None).startswith("not attempted yet")
    assert check_sliding_window_cache(solutions.MySlidingWindowCache).startswith("right")

    class FullCache:  # right values, but keeps every position: memory grows with the text
        def __init__(self, n_layers, B, window, H, d, dtype=torch.float32):
            self.window, self.cache = window, KVCache(n_layers, B, 64, H, d, dtype)

        def update(self, layer_idx, start_pos, k, v):
            k_all, v_all = self.cache.update(layer_idx, start_pos, k, v)
            return k_all[:, :, -self.window:], v_all[:, :, -self.window:]

    class StorageOrder(solutions.MySlidingWindowCache):  # a ring buffer returned as stored, not oldest first
        def update(self, layer_idx, start_pos, k, v):
            super().update(layer_idx, start_pos, k, v)
            n = min(start_pos + k.shape[2], self.window)
            return self.k[layer_idx, :, :, :n], self.v[layer_idx, :, :, :n]

    class OneTooMany(FullCache):  # window + 1 positions
        def update(self, layer_idx, start_pos, k, v):
            k_all, v_all = self.cache.update(layer_idx, start_pos, k, v)
            return k_all[:, :, -self.window - 1:], v_all[:, :, -self.window - 1:]

    verdict = check_sliding_window_cache(FullCache)
    assert verdict.startswith("wrong: the values are right, but your cache holds"), verdict
    verdict = check_sliding_window_cache(StorageOrder)
    assert verdict.startswith("wrong: after writing 1 token(s) at start_pos 5, layer 0: the keys differs"), verdict
    verdict = check_sliding_window_cache(OneTooMany)
    assert verdict.startswith("wrong: after writing 1 token(s) at start_pos 5, layer 0: the keys has shape"), verdict
