"""Lesson 29's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_29 import check_absorbed_scores, check_cache_bytes, check_group_routing


@pytest.fixture(scope="module")
def sol():
    return load_solutions("29_latent_attention")


def test_check_cache_bytes(sol):
    assert check_cache_bytes(None).startswith("not attempted yet")
    assert check_cache_bytes(sol.my_cache_bytes).startswith("right")

    def sizes(c):
        return (c["num_hidden_layers"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"],
                c["qk_rope_head_dim"], c["v_head_dim"])

    def no_rope(c):
        L, H, r, dn, dr, dv = sizes(c)
        return 2 * L * r, 2 * L * H * (dn + dr + dv)

    def per_head(c):
        L, H, r, dn, dr, dv = sizes(c)
        return 2 * L * H * (r + dr), 2 * L * H * (dn + dr + dv)

    def fp32(c):
        L, H, r, dn, dr, dv = sizes(c)
        return 4 * L * (r + dr), 4 * L * H * (dn + dr + dv)

    def keys_only(c):
        L, H, r, dn, dr, dv = sizes(c)
        return 2 * L * (r + dr), 2 * L * H * (dn + dr)

    def one_layer(c):
        L, H, r, dn, dr, dv = sizes(c)
        return 2 * (r + dr), 2 * H * (dn + dr + dv)

    for wrong, why in ((no_rope, "rope key beside the latent"), (per_head, "shared by every head"),
                       (fp32, "2 bytes a number"), (keys_only, "its value too"), (one_layer, "every layer"),
                       (lambda c: 5, "return a pair")):
        result = check_cache_bytes(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)


def test_check_absorbed_scores(sol):
    assert check_absorbed_scores(None).startswith("not attempted yet")
    assert check_absorbed_scores(sol.my_absorbed_scores).startswith("right")

    def latent_only(q_nope, q_rope, c_kv, k_rope, w_uk):
        return (q_nope @ w_uk) @ c_kv.T

    def rope_only(q_nope, q_rope, c_kv, k_rope, w_uk):
        return q_rope @ k_rope.T

    def scaled(q_nope, q_rope, c_kv, k_rope, w_uk):
        return (q_nope @ w_uk @ c_kv.T + q_rope @ k_rope.T) * (q_nope.shape[1] + q_rope.shape[1]) ** -0.5

    def transposed(q_nope, q_rope, c_kv, k_rope, w_uk):  # W_UK used the wrong way round: a shape error
        return (q_nope @ w_uk.T) @ c_kv.T + q_rope @ k_rope.T

    def minus_rope(q_nope, q_rope, c_kv, k_rope, w_uk):
        return q_nope @ w_uk @ c_kv.T - q_rope @ k_rope.T

    for wrong, why in ((latent_only, "only the latent part"), (rope_only, "only the rope part"),
                       (scaled, "scaled"), (transposed, "raised RuntimeError"), (minus_rope, "W_UK to the query")):
        result = check_absorbed_scores(wrong)
        assert result.startswith("wrong") and why in result, (wrong.__name__, result)


def test_check_group_routing(sol):
    assert check_group_routing(None).startswith("not attempted yet")
    assert check_group_routing(sol.my_group_routing).startswith("right")

    def routed(scores, bias, n_group, topk_group, k, group_by="top2", groups_biased=True, experts_biased=True,
               weigh_biased=False, normalise=True, groups=True):
        N, E = scores.shape
        biased = scores + bias
        g_in = (biased if groups_biased else scores).view(N, n_group, -1)
        g = g_in.topk(2, dim=-1).values.sum(-1) if group_by == "top2" else g_in.max(-1).values
        keep = torch.zeros(N, n_group, dtype=torch.bool).scatter_(1, g.topk(topk_group, dim=-1).indices, True)
        pick = biased if experts_biased else scores
        if groups:
            pick = pick.view(N, n_group, -1).masked_fill(~keep[..., None], float("-inf")).view(N, E)
        experts = pick.topk(k, dim=-1).indices
        weights = (biased if weigh_biased else scores).gather(1, experts)
        return (weights / weights.sum(-1, keepdim=True) if normalise else weights), experts

    cases = ((dict(group_by="max"), "not by their best one"), (dict(groups_biased=False), "choosing the groups too"),
             (dict(experts_biased=False), "chosen by the biased scores"), (dict(weigh_biased=True), "does not weigh"),
             (dict(normalise=False), "normalise"), (dict(groups=False), "topk_group best groups"))
    for changes, why in cases:
        result = check_group_routing(lambda *a, changes=changes: routed(*a, **changes))
        assert result.startswith("wrong") and why in result, (changes, result)
    result = check_group_routing(lambda *a: routed(*a)[1])
    assert result.startswith("wrong") and "return a pair" in result
