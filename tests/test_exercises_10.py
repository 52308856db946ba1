"""Lesson 10's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers."""

import json

import torch

from hardway.course import STANDIN_ID
from hardway.exercises.lesson_10 import check_kv_cache_bytes, check_llama_param_count
from hardway.formats.hub import checkpoint
from exercise_solutions import load_solutions



def _solutions():
    return load_solutions("10_llama_gpu")


def test_check_llama_param_count():
    config = json.loads((checkpoint(STANDIN_ID) / "config.json").read_text())
    solution = _solutions().my_llama_param_count
    assert check_llama_param_count(None, config).startswith("not attempted yet")
    assert check_llama_param_count(solution, config).startswith("right")

    def no_gqa(cfg):  # k_proj and v_proj as wide as q_proj
        return solution({**cfg, "num_key_value_heads": cfg["num_attention_heads"]})

    def tie_ignored(cfg):  # the head counted even when tied
        return solution({**cfg, "tie_word_embeddings": False})

    def no_norms(cfg):
        return solution(cfg) - (cfg["num_hidden_layers"] * 2 + 1) * cfg["hidden_size"]

    def head_dim_from_hidden(cfg):  # ignores an explicit head_dim
        return solution({k: v for k, v in cfg.items() if k != "head_dim"})

    for wrong in (no_gqa, tie_ignored, no_norms):
        assert check_llama_param_count(wrong, config).startswith("wrong: this lesson's model"), wrong.__name__
    assert check_llama_param_count(lambda cfg: float(solution(cfg)), config).startswith("wrong:")
    assert "head_dim is not hidden_size / heads" in check_llama_param_count(head_dim_from_hidden, config)


def test_check_kv_cache_bytes():
    solution = _solutions().my_kv_cache_bytes
    assert check_kv_cache_bytes(None).startswith("not attempted yet")
    assert check_kv_cache_bytes(solution).startswith("right")

    def keys_only(cfg, batch_size, seq_len, dtype):
        return solution(cfg, batch_size, seq_len, dtype) // 2

    def query_heads(cfg, batch_size, seq_len, dtype):
        return solution({**cfg, "num_key_value_heads": cfg["num_attention_heads"]}, batch_size, seq_len, dtype)

    def batch_forgotten(cfg, batch_size, seq_len, dtype):
        return solution(cfg, 1, seq_len, dtype)

    def always_bf16(cfg, batch_size, seq_len, dtype):
        return solution(cfg, batch_size, seq_len, torch.bfloat16)

    def head_dim_from_hidden(cfg, batch_size, seq_len, dtype):  # the second config's head_dim is 32, not 96 / 6
        return solution({k: v for k, v in cfg.items() if k != "head_dim"}, batch_size, seq_len, dtype)

    for wrong in (keys_only, query_heads, batch_forgotten):
        assert check_kv_cache_bytes(wrong).startswith("wrong: {'vocab_size': 64, 'hidden_size': 64"), wrong.__name__
    assert "torch.float32" in check_kv_cache_bytes(always_bf16)
    assert "'head_dim': 32" in check_kv_cache_bytes(head_dim_from_hidden)
