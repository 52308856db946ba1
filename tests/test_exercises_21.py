"""Lesson 21's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from exercise_solutions import load_solutions
from hardway.exercises.lesson_21 import (BUGS, CONFIGS, check_active_bytes, check_diagnosis, check_topk_then_softmax,
                                         mystery_moe)
from hardway.loading import load
from hardway.models.moe import MoEConfig, active_parameters, total_parameters, MoE


@pytest.fixture(scope="module")
def sol():
    return load_solutions("21_mixture_of_experts")


def test_active_parameters_is_the_count_of_what_one_token_runs():
    """The reference itself, counted another way: the model's parameters on the meta device, minus the embedding
    table (unless tied) and the E - k experts a token skips in each sparse block."""
    for d in CONFIGS.values():
        config = MoEConfig.from_dict(d)
        with torch.device("meta"):
            model = MoE(config)
        skipped = sum(config.sparse_layers) * (config.num_experts - config.num_experts_per_tok) * 3 * \
            config.hidden_size * config.moe_intermediate_size
        table = 0 if config.tie_word_embeddings else model.tok_emb.weight.numel()
        assert active_parameters(config) == total_parameters(model) - table - skipped


def test_check_active_bytes(sol):
    assert check_active_bytes(None).startswith("not attempted yet")
    result = check_active_bytes(sol.my_active_bytes)
    assert result.startswith("right"), result

    def with_the_table(config, b):
        return sol.my_active_bytes(config, b) + config["vocab_size"] * config["hidden_size"] * b

    def every_expert(config, b):
        E = config.get("num_local_experts", config.get("num_experts"))
        return sol.my_active_bytes(dict(config, num_experts_per_tok=E), b)

    def no_router(config, b):
        E = config.get("num_local_experts", config.get("num_experts"))
        return sol.my_active_bytes(config, b) - config["num_hidden_layers"] * config["hidden_size"] * E * b

    def all_layers_sparse(config, b):
        return sol.my_active_bytes({k: v for k, v in config.items() if k not in ("mlp_only_layers",
                                                                               "decoder_sparse_step")}, b)

    assert "you counted the embedding table" in check_active_bytes(with_the_table)
    assert "you counted every expert" in check_active_bytes(every_expert)
    assert "the router's (E, C) matrix" in check_active_bytes(no_router)
    verdict = check_active_bytes(all_layers_sparse)
    assert verdict.startswith("wrong: a Qwen3-MoE with dense blocks") and "some blocks have no experts" in verdict
    assert check_active_bytes(lambda c, b: "many").startswith("wrong: Mixtral-8x7B: expected a number")


def test_check_topk_then_softmax(sol):
    assert check_topk_then_softmax(None).startswith("not attempted yet")
    result = check_topk_then_softmax(sol.my_route)
    assert result.startswith("right"), result

    def softmax_then_topk(logits, k):  # not renormalised: the weights sum to less than 1
        return torch.topk(torch.softmax(logits, -1), k, dim=-1)

    def smallest_first(logits, k):
        w, e = torch.topk(logits, k, dim=-1, largest=False)
        return torch.softmax(w, -1), e

    def softmax_over_tokens(logits, k):
        w, e = torch.topk(logits, k, dim=-1)
        return torch.softmax(w, 0), e

    assert "softmax-then-top-k without renormalising" in check_topk_then_softmax(softmax_then_topk)
    assert check_topk_then_softmax(smallest_first).startswith("wrong: E=8, k=2: the experts differ")
    assert check_topk_then_softmax(softmax_over_tokens).startswith("wrong: E=8, k=2: the weights differ")
    assert check_topk_then_softmax(lambda logits, k: logits).startswith("wrong: my_route should return")


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mixtral")
    MixtralForCausalLM(MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=128,
                                     initializer_range=0.2)).save_pretrained(folder)
    return folder


def test_the_mystery_has_the_planted_bug_and_the_evidence_shows_it(tiny_mixtral):
    """The planted bug changes the logits, and the evidence the check names tells it apart: the router's weights
    sum to 1, and a token's block output is its experts' outputs with their two weights exchanged."""
    model, mystery = load(tiny_mixtral), mystery_moe(tiny_mixtral)
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert (model(ids) - mystery(ids)).abs().max() > 1e-2
        block = mystery.blocks[0]
        rows = block.mlp_norm(mystery.embed(ids))[0]  # (16, C) close enough to a block's MLP input for the check
        weights, chosen = block.mlp.gate(rows)
        assert torch.allclose(weights.sum(-1), torch.ones(16))
        out = block.mlp(rows[None])[0]  # (16, C)
        experts = block.mlp.experts
        one = torch.stack([experts.expert(int(e), rows[t:t + 1])[0] for t, e in enumerate(chosen[:, 0])])
        two = torch.stack([experts.expert(int(e), rows[t:t + 1])[0] for t, e in enumerate(chosen[:, 1])])
        swapped = weights[:, 1:] * one + weights[:, :1] * two
        right = weights[:, :1] * one + weights[:, 1:] * two
        assert (out - swapped).abs().max() < 1e-5 < (out - right).abs().max()


def test_check_diagnosis(sol):
    assert check_diagnosis(None).startswith("not attempted yet: set my_diagnosis to your answer")
    result = check_diagnosis(sol.my_diagnosis)
    assert result.startswith("right"), result
    for wrong in BUGS:
        if wrong != sol.my_diagnosis:
            assert check_diagnosis(wrong).startswith(f"wrong: not {wrong!r}: ")
    assert check_diagnosis("the router").startswith("wrong: 'the router' is not one of")
