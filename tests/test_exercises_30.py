"""Lesson 30's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_30 import check_cache_bytes_per_token, check_inv_freq, check_kv_sources


@pytest.fixture(scope="module")
def sol():
    return load_solutions("30_gemma4")


def test_check_kv_sources(sol):
    assert check_kv_sources(None).startswith("not attempted yet")
    result = check_kv_sources(sol.my_kv_sources)
    assert result.startswith("right") and "layer 19 reads layer 14" in result, result

    def first_of_type(types, n_shared):
        first = len(types) - n_shared
        return [i if i < first else types.index(types[i]) for i in range(len(types))]

    def layer_before_shared(types, n_shared):
        first = len(types) - n_shared
        return [i if i < first else first - 1 for i in range(len(types))]

    def itself(types, n_shared):  # no sharing at all
        return list(range(len(types)))

    def one_short(types, n_shared):
        return list(range(len(types)))[:-1]

    for wrong, why in ((first_of_type, "reads the LAST earlier layer"), (layer_before_shared, "of its own type"),
                       (itself, "reads layer"), (one_short, "one layer index per layer")):
        result = check_kv_sources(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)


def test_check_cache_bytes_per_token(sol):
    assert check_cache_bytes_per_token(None).startswith("not attempted yet")
    result = check_cache_bytes_per_token(sol.my_cache_bytes_per_token)
    assert result.startswith("right") and "E2B: 18,432" in result, result

    def layer_types(c):
        n = c["num_hidden_layers"]
        types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        return list(types[:-1]) + ["full_attention"]

    def counting(every_layer=False, one_size=False, halve=False, global_heads_always=False):
        def answer(c):
            types = layer_types(c)
            n = len(types) if every_layer else len(types) - c.get("num_kv_shared_layers", 0)
            total = 0
            for kind in types[:n]:
                full = kind == "full_attention"
                heads = c.get("num_key_value_heads", 4)
                if full and (c.get("attention_k_eq_v") or global_heads_always):
                    heads = c.get("num_global_key_value_heads") or heads
                dim = c.get("global_head_dim", 512) if full and not one_size else c.get("head_dim", 256)
                total += (1 if halve and full and c.get("attention_k_eq_v") else 2) * heads * dim * 2
            return total
        return answer

    for wrong, why in ((counting(every_layer=True), "count only the layers before them"),
                       (counting(one_size=True), "global_head_dim wide"),
                       (counting(halve=True), "still cache both"),
                       (counting(global_heads_always=True), "only where attention_k_eq_v is set"),
                       (lambda c: sol.my_cache_bytes_per_token(c) // 2, "expected 18,432 bytes"),
                       (lambda c: "18432", "return a number")):
        result = check_cache_bytes_per_token(wrong)
        assert result.startswith("wrong") and why in result, result


def test_check_inv_freq(sol):
    assert check_inv_freq(None).startswith("not attempted yet")
    assert check_inv_freq(sol.my_inv_freq).startswith("right")

    def turned_only(d, theta, p):
        n = int(p * d // 2)
        return 1.0 / theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float) / d)

    def qwen_partial(d, theta, p):  # lesson 27's: the frequencies of a head of p·d
        n = int(p * d // 2)
        return torch.cat([1.0 / theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float) / (2 * n)),
                          torch.zeros(d // 2 - n)])

    def zeros_first(d, theta, p):
        n = int(p * d // 2)
        return torch.cat([torch.zeros(d // 2 - n), 1.0 / theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float) / d)])

    def every_pair(d, theta, p):
        return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)

    for wrong, why in ((turned_only, "all d/2"), (qwen_partial, "lesson 27's partial-RoPE"),
                       (zeros_first, "the zeros come after"), (every_pair, "the frequencies")):
        result = check_inv_freq(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)
