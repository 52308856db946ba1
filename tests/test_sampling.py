"""Logits processors and sampling (lesson 07) against transformers' processors of the same name, on the same inputs."""

import pytest
import torch
from transformers.generation import logits_process as hf

from hardway.decode.sampling import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, build_processors, sample_next_token)

V = 1000


def random_inputs(seed, B=4, T=30, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, V, generator=g) * scale  # (B, V), positive and negative logits
    ids = torch.randint(0, V, (B, T), generator=g)  # (B, T)
    return ids, scores


def assert_same(ours, theirs, ids, scores):
    """Exactly equal outputs (same -inf pattern, same finite values), and the input left untouched."""
    before = scores.clone()
    a = ours(ids, scores)
    b = theirs(ids, scores.clone())
    assert torch.equal(scores, before), "processor modified its input in place"
    assert a.shape == b.shape == scores.shape
    assert torch.equal(a, b), f"max |Δ| = {(a - b).nan_to_num().abs().max().item()}, filtered differently: " \
                              f"{(torch.isinf(a) != torch.isinf(b)).sum().item()} entries"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("t", [0.01, 0.5, 0.7, 1.0, 1.7, 10.0])
def test_temperature_equals_transformers(seed, t):
    ids, scores = random_inputs(seed)
    assert_same(TemperatureLogitsWarper(t), hf.TemperatureLogitsWarper(t), ids, scores)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 2, 10, 50, V - 1, V, V + 5])
def test_top_k_equals_transformers(seed, k):
    ids, scores = random_inputs(seed)
    assert_same(TopKLogitsWarper(k), hf.TopKLogitsWarper(k), ids, scores)


@pytest.mark.parametrize("k", [1, 3, 5, 7, 8])
def test_top_k_keeps_every_value_tied_with_the_kth(k):
    ids, scores = random_inputs(0)
    scores[:, 100:107] = 20.0  # seven tokens tied at the top
    scores[1, 200:210] = -30.0  # and a tie at the bottom of row 1
    ours = TopKLogitsWarper(k)(ids, scores)
    assert_same(TopKLogitsWarper(k), hf.TopKLogitsWarper(k), ids, scores)
    kept = torch.isfinite(ours).sum(dim=-1)  # (B,)
    assert kept.tolist() == [max(k, 7)] * 4  # k <= 7 falls inside the tie: all seven survive


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p", [0.0, 1e-9, 0.05, 0.3, 0.5, 0.9, 0.95, 0.999999, 1.0])
def test_top_p_equals_transformers(seed, p):
    ids, scores = random_inputs(seed)
    assert_same(TopPLogitsWarper(p), hf.TopPLogitsWarper(p), ids, scores)


def test_top_p_edge_values():
    ids, scores = random_inputs(1)
    tiny = TopPLogitsWarper(1e-9)(ids, scores)
    assert torch.isfinite(tiny).sum(dim=-1).tolist() == [1] * 4, "p close to 0 must keep exactly one token"
    assert torch.equal(tiny.argmax(-1), scores.argmax(-1)), "the one kept token is the most likely"
    assert torch.equal(TopPLogitsWarper(1.0)(ids, scores), scores), "p = 1 keeps everything"
    peaked = scores.clone()
    peaked[:, 5] = 100.0  # one token holds ~all the mass: even p = 0.99 keeps only it
    assert torch.isfinite(TopPLogitsWarper(0.99)(ids, peaked)).sum(dim=-1).tolist() == [1] * 4
    assert_same(TopPLogitsWarper(0.99), hf.TopPLogitsWarper(0.99), ids, peaked)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.2, 2.0])
def test_repetition_penalty_equals_transformers(seed, penalty):
    ids, scores = random_inputs(seed)
    assert_same(RepetitionPenaltyLogitsProcessor(penalty), hf.RepetitionPenaltyLogitsProcessor(penalty), ids, scores)


def test_repetition_penalty_repeated_ids_and_negative_logits():
    scores = torch.tensor([[2.0, -2.0, 0.5, -0.5, 1.0]])  # (1, 5)
    ids = torch.tensor([[0, 1, 1, 1, 3, 0]])  # token 1 three times, 0 twice: penalised once each
    ours = RepetitionPenaltyLogitsProcessor(2.0)(ids, scores)
    assert ours.tolist() == [[1.0, -4.0, 0.5, -1.0, 1.0]]
    assert_same(RepetitionPenaltyLogitsProcessor(2.0), hf.RepetitionPenaltyLogitsProcessor(2.0), ids, scores)


def test_chain_in_transformers_order_equals_transformers_chain():
    ids, scores = random_inputs(5)
    ours = build_processors(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.3)
    assert [type(p).__name__ for p in ours] == [
        "RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    theirs = hf.LogitsProcessorList([hf.RepetitionPenaltyLogitsProcessor(1.3), hf.TemperatureLogitsWarper(0.7),
                                     hf.TopKLogitsWarper(50), hf.TopPLogitsWarper(0.9)])
    assert_same(ours, theirs, ids, scores)


def test_greedy_chain_keeps_only_the_repetition_penalty_and_neutral_values_add_nothing():
    greedy = build_processors(do_sample=False, temperature=0.5, top_k=5, top_p=0.5, repetition_penalty=1.1)
    assert [type(p).__name__ for p in greedy] == ["RepetitionPenaltyLogitsProcessor"]
    assert len(build_processors(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)) == 0
    assert isinstance(build_processors(), LogitsProcessorList)


@pytest.mark.parametrize("make", [
    lambda: TemperatureLogitsWarper(0.0), lambda: TemperatureLogitsWarper(-1.0), lambda: TopKLogitsWarper(0),
    lambda: TopKLogitsWarper(2.5), lambda: TopPLogitsWarper(1.5), lambda: TopPLogitsWarper(-0.1),
    lambda: RepetitionPenaltyLogitsProcessor(0.0)])
def test_bad_settings_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_greedy_is_argmax():
    _, scores = random_inputs(2)
    assert torch.equal(sample_next_token(scores, do_sample=False), scores.argmax(dim=-1))


def test_seeded_sampling_is_reproducible_and_respects_filtering():
    ids, scores = random_inputs(3)
    chain = build_processors(do_sample=True, temperature=1.5, top_k=20)
    filtered = chain(ids, scores)  # (B, V)
    draws = [sample_next_token(filtered, True, torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert torch.equal(draws[0], draws[1])
    many = torch.stack([sample_next_token(filtered, True, torch.Generator().manual_seed(s)) for s in range(50)])
    assert torch.isfinite(filtered.gather(1, many.T)).all(), "drew a token that top-k removed"
    assert len(set(many[:, 0].tolist())) > 1, "50 seeds drew the same token every time: not sampling"


def test_global_seed_matches_transformers_draw():
    """generator=None draws from torch's global RNG exactly as transformers' _sample does."""
    _, scores = random_inputs(4)
    torch.manual_seed(11)
    ours = sample_next_token(scores, do_sample=True)
    torch.manual_seed(11)
    theirs = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("t", [1e-40, 1e-38])
def test_a_tiny_temperature_is_its_limit_not_nan(t):
    """Logits of a few units divided by 1e-40 pass float32's range (inf), and softmax of inf is NaN: the draw used
    to fail. Such a temperature is now its T -> 0 limit: every row's largest logit gets all the probability."""
    ids, scores = random_inputs(0)
    warped = TemperatureLogitsWarper(t)(ids, scores)  # (B, V)
    probs = warped.softmax(dim=-1)
    assert probs.isfinite().all() and torch.equal(probs.argmax(dim=-1), scores.argmax(dim=-1))
    assert torch.equal(probs.max(dim=-1).values, torch.ones(len(scores)))
    draws = sample_next_token(warped, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draws, scores.argmax(dim=-1))
