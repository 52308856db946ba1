"""Lesson 20's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from exercise_solutions import load_solutions
from hardway.exercises.lesson_20 import (GEMMA3_270M, PLANTED, check_diagnosis, check_kv_cache_bytes,
                                         check_weight_bytes, planted_gemma)
from hardway.loading import load


@pytest.fixture(scope="module")
def sol():
    return load_solutions("20_new_architectures")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The lesson's tiny Gemma 3 (window 8, layer 2 full), saved by transformers and loaded by hardway."""
    torch.manual_seed(0)
    ref = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=256, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    folder = tmp_path_factory.mktemp("gemma3")
    ref.save_pretrained(folder)
    return load(folder), ref


def test_check_diagnosis(sol, gemma):
    assert check_diagnosis(None).startswith("not attempted yet")
    ours, ref = gemma
    ids = torch.randint(3, 160, (1, 30), generator=torch.Generator().manual_seed(1))
    found = sol.diagnose(planted_gemma(ours), ref, ids)  # the solution's method finds what was planted
    assert found == PLANTED == sol.my_diagnosis, found
    result = check_diagnosis(sol.my_diagnosis)
    assert result.startswith("right"), result
    for wrong, why in (({"layer": 3, "part": "mlp_norm"}, "not the first"),  # a later layer: the spread
                       ({"layer": 0, "part": "mlp_norm"}, "matches"),
                       ({"layer": 1, "part": "post_mlp_norm"}, "first whose output differs"),  # after the mistake
                       ({"layer": 1, "part": "attn"}, "matches transformers'"),
                       ({"layer": 1, "part": "ffn"}, "not one of"),
                       ((1, "mlp_norm"), "give a dict")):
        result = check_diagnosis(wrong)
        assert result.startswith("wrong") and why in result, (wrong, result)


def test_check_kv_cache_bytes(sol):
    assert check_kv_cache_bytes(None).startswith("not attempted yet")
    result = check_kv_cache_bytes(sol.my_kv_cache_bytes)
    assert result.startswith("right"), result
    every, windowed = sol.my_kv_cache_bytes(GEMMA3_270M, 4096, 2)
    assert (every, windowed) == (2 * 18 * 256 * 2 * 4096, 2 * 256 * 2 * (3 * 4096 + 15 * 512))  # by hand

    def only_keys(config, n, b):
        every, windowed = sol.my_kv_cache_bytes(config, n, b)
        return every // 2, windowed // 2

    def query_heads(config, n, b):
        return sol.my_kv_cache_bytes({**config, "num_key_value_heads": config["num_attention_heads"]}, n, b)

    def every_sixth_sliding(config, n, b):  # the pattern read backwards: 1 sliding layer in 6
        flipped = {**config, "layer_types": ["full_attention" if (i + 1) % 6 else "sliding_attention"
                                             for i in range(config["num_hidden_layers"])]}
        return sol.my_kv_cache_bytes(config, n, b)[0], sol.my_kv_cache_bytes(flipped, n, b)[1]

    def window_minus_one(config, n, b):  # W - 1 slots: the query's own key forgotten
        return sol.my_kv_cache_bytes(config, n, b)[0], sol.my_kv_cache_bytes(
            {**config, "sliding_window": config["sliding_window"] - 1}, n, b)[1]

    for wrong, why in ((only_keys, "a key AND a value"), (query_heads, "num_key_value_heads"),
                       (every_sixth_sliding, "layer_types"), (window_minus_one, "query's own key"),
                       (lambda c, n, b: 42, "pair")):
        result = check_kv_cache_bytes(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)

    def window_not_capped(config, n, b):  # a sliding layer charged W slots before the sequence has W positions
        every, windowed = sol.my_kv_cache_bytes(config, n, b)
        n_sliding = sum(1 for i in range(config["num_hidden_layers"]) if (i + 1) % config["sliding_window_pattern"]) \
            if "layer_types" not in config else config["layer_types"].count("sliding_attention")
        per_position = 2 * config["num_key_value_heads"] * config["head_dim"] * b
        return every, windowed + n_sliding * per_position * max(0, config["sliding_window"] - n)

    result = check_kv_cache_bytes(window_not_capped)
    assert result.startswith("wrong") and "min(W, n)" in result, result


def test_check_weight_bytes(sol):
    assert check_weight_bytes(None).startswith("not attempted yet")
    result = check_weight_bytes(sol.my_weight_bytes)
    assert result.startswith("right") and "Gemma 3 270M reads 536 MB" in result, result

    def head_twice(config, b):  # the tie ignored: the head counted as a matrix of its own
        return sol.my_weight_bytes({**config, "tie_word_embeddings": False}, b)

    def attention_c_wide(config, b):  # q, k, v and o as (C, C): n_heads x head_dim taken to be hidden_size
        C, n, kv, d = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
        return sol.my_weight_bytes(config, b) + b * config["num_hidden_layers"] * (4 * C * C - 2 * (n + kv) * d * C)

    def kv_with_every_head(config, b):
        return sol.my_weight_bytes({**config, "num_key_value_heads": config["num_attention_heads"]}, b) - (
            b * config["num_hidden_layers"] * 2 * config["head_dim"] * (config["num_attention_heads"]
                                                                        - config["num_key_value_heads"])
            if config.get("attention_bias") else 0)

    def two_norms_a_block(config, b):  # Llama's two
        return sol.my_weight_bytes(config, b) - b * config["num_hidden_layers"] * 2 * config["hidden_size"]

    def no_qk_norms(config, b):
        return sol.my_weight_bytes(config, b) - b * config["num_hidden_layers"] * 2 * config["head_dim"]

    def two_mlp_matrices(config, b):
        return sol.my_weight_bytes(config, b) - b * config["num_hidden_layers"] * config["hidden_size"] * \
            config["intermediate_size"]

    for wrong, why in ((head_twice, "tied head"), (attention_c_wide, "not hidden_size"),
                       (kv_with_every_head, "num_key_value_heads heads"), (two_norms_a_block, "four norms"),
                       (no_qk_norms, "for q and k"), (two_mlp_matrices, "three matrices")):
        result = check_weight_bytes(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)
