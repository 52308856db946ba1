"""Lesson 27's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_27 import check_delta_step, check_prefill_in_pieces, check_state_positions


@pytest.fixture(scope="module")
def sol():
    return load_solutions("27_recurrent_state")


def test_check_delta_step(sol):
    assert check_delta_step(None).startswith("not attempted yet")
    assert check_delta_step(sol.my_delta_step).startswith("right")

    def late_decay(S, q, k, v, g, beta):
        S = (S + torch.outer(k, beta * (v - k @ S))) * torch.tensor(g).exp()
        return q @ S, S

    def stale_read(S, q, k, v, g, beta):
        read = k @ S
        S = S * torch.tensor(g).exp() + torch.outer(k, beta * (v - read))
        return q @ S, S

    def plain_write(S, q, k, v, g, beta):
        S = S * torch.tensor(g).exp() + torch.outer(k, beta * v)
        return q @ S, S

    def read_before_write(S, q, k, v, g, beta):
        S = S * torch.tensor(g).exp()
        out = q @ S
        return out, S + torch.outer(k, beta * (v - k @ S))

    def decay_by_g(S, q, k, v, g, beta):  # g used as the factor itself, not exp(g)
        S = S * g + torch.outer(k, beta * (v - k @ (S * g)))
        return q @ S, S

    for wrong, why in ((late_decay, "decays after the write"), (stale_read, "before its decay"),
                       (plain_write, "only the error"), (read_before_write, "it has just written"),
                       (decay_by_g, "differs first"), (lambda *a: a[0], "return a pair")):
        result = check_delta_step(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)


def test_check_prefill_in_pieces(sol):
    assert check_prefill_in_pieces(None).startswith("not attempted yet")
    assert check_prefill_in_pieces(sol.my_prefill_in_pieces).startswith("right")

    def fresh_cache_each_piece(model, ids, piece):
        for start in range(0, ids.shape[1], piece):
            logits = model(ids[:, start:start + piece])
        return logits[:, -1]

    def restart_at_zero(model, ids, piece):
        cache = model.new_kv_cache(1, ids.shape[1])
        for start in range(0, ids.shape[1], piece):
            logits = model(ids[:, start:start + piece], kv_cache=cache, start_pos=0)
        return logits[:, -1]

    def wrong_positions(model, ids, piece):  # start_pos counts pieces, not tokens
        cache = model.new_kv_cache(1, ids.shape[1])
        for i, start in enumerate(range(0, ids.shape[1], piece)):
            logits = model(ids[:, start:start + piece], kv_cache=cache, start_pos=i)
        return logits[:, -1]

    for wrong, why in ((fresh_cache_each_piece, "last piece alone"), (restart_at_zero, "last piece alone"),
                       (wrong_positions, "cannot rewind")):
        result = check_prefill_in_pieces(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)


def test_check_state_positions(sol):
    assert check_state_positions(None).startswith("not attempted yet")
    result = check_state_positions(sol.my_state_positions)
    assert result.startswith("right") and "Qwen3.5 default: 804" in result, result

    def counting(conv=True, value_heads=True, width=-1, kv_layers="full_attention"):
        def answer(config):
            types = config.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                  for i in range(config["num_hidden_layers"])]
            h_k, h_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
            d_k, d_v = config["linear_key_head_dim"], config["linear_value_head_dim"]
            conv_dim = 2 * h_k * d_k + h_v * d_v
            per = (h_v if value_heads else h_k) * d_k * d_v + (conv_dim * (config["linear_conv_kernel_dim"] + width)
                                                               if conv else 0)
            n_kv = len(types) if kv_layers == "all" else types.count("full_attention")
            return types.count("linear_attention") * per / (2 * n_kv * config["num_key_value_heads"] * config["head_dim"])
        return answer

    for wrong, why in ((counting(conv=False), "convolution's state is missing"), (counting(width=0), "not K"),
                       (counting(value_heads=False), "per value head"), (counting(kv_layers="all"), "only the full"),
                       (lambda c: 1000.0, "expected 804"), (lambda c: "804", "return a number")):
        result = check_state_positions(wrong)
        assert result.startswith("wrong") and why in result, result
