"""Lesson 19's tensor parallelism: GPT-2 split over ranks gives the whole model's logits (simulated in one process,
over 2, 3 and 4 ranks), the vocabulary split as vLLM splits it gives the whole table's lookups and logits, the KV
cache of each rank's own heads decodes what one process decodes, and two real processes (gloo on 127.0.0.1)
generate the same greedy tokens as one, with the collectives the design says."""
import copy

import pytest
import torch
import torch.nn.functional as F

from hardway.decode.generate import generate
from hardway.formats.hub import checkpoint
from hardway.loading import forward_once, load
from hardway.tensor_parallel import (attention_partial, check_divisible, embed_partial, logits_partial, mlp_partial,
                                     padded_vocab, run_tensor_parallel, shard_block, shard_gpt2, shard_vocab,
                                     tp_forward, tp_generate)
from hardway.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    folder = checkpoint("openai-community/gpt2")
    model, tokenizer = load(folder), load_tokenizer(folder)
    return folder, model, tokenizer.encode("The three most important numbers in inference engineering are")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_partial_sums_add_up_to_each_half_of_a_block(gpt2, world):
    _, model, ids = gpt2
    block = copy.deepcopy(model.h[3])
    with torch.no_grad():  # the stand-in's biases are zeros: random ones, so that a bias added twice would show
        for linear in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            linear.bias.normal_(0, 0.1)
        x = model.embed(torch.tensor([ids]))  # (1, T, C)
        shards = [shard_block(block, r, world) for r in range(world)]
        attn = sum(attention_partial(s, block.ln_1(x)) for s in shards)  # the row-parallel bias in rank 0's only
        mlp = sum(mlp_partial(s, block.ln_2(x)) for s in shards)
        assert (attn - block.attn(block.ln_1(x))).abs().max() < 1e-5
        assert (mlp - block.mlp(block.ln_2(x))).abs().max() < 1e-5
        assert shards[0].qkv_weight.shape == (3 * 768 // world, 768) and shards[0].fc_weight.shape == (3072 // world, 768)
        assert shards[0].proj_bias is not None and all(s.proj_bias is None and s.fc_proj_bias is None for s in shards[1:])


def test_the_vocabulary_split_gives_the_whole_tables_lookups_and_logits(gpt2):
    _, model, ids = gpt2
    assert padded_vocab(50257, 2) == 50304  # vLLM's padding: a multiple of 64
    with torch.no_grad():
        h = model.ln_f(model.embed(torch.tensor([ids])))  # (1, T, C)
        for world in (2, 4):
            vocab = [shard_vocab(model.wte.weight, r, world) for r in range(world)]
            assert [v.start for v in vocab] == [r * 50304 // world for r in range(world)]
            embedded = sum(embed_partial(v, torch.tensor([ids])) for v in vocab)
            assert torch.equal(embedded, model.wte(torch.tensor([ids])))  # adding zeros is exact
            logits = torch.cat([logits_partial(v, h) for v in vocab], dim=-1)  # (1, T, 50304)
            assert (logits[..., :50257] - F.linear(h, model.wte.weight)).abs().max() < 1e-5
            assert torch.isneginf(logits[..., 50257:]).all()  # padding ids: never chosen


def test_heads_units_and_vocabulary_that_do_not_split_evenly_are_refused():
    with pytest.raises(ValueError, match="9 attention heads and 1536 MLP units do not split evenly over 2 ranks"):
        check_divisible(9, 1536, 2)  # SmolLM2-135M over 2 ranks: vLLM refuses it too
    check_divisible(9, 1536, 3)
    with pytest.raises(ValueError, match="a vocabulary of 50257 tokens, padded to 50304, does not split evenly over 5"):
        padded_vocab(50257, 5)


def test_simulated_ranks_with_their_own_kv_caches_decode_what_one_process_decodes(gpt2):
    _, model, ids = gpt2
    whole = forward_once(model, torch.tensor([ids]))
    for world in (2, 3):
        ranks = [shard_gpt2(model, r, world) for r in range(world)]
        assert (tp_forward(ranks, torch.tensor([ids])) - whole).abs().max() < 1e-4
    gen = tp_generate(ranks, ids, n_new=5)  # 3 ranks in this process, each with a cache of its 4 heads
    expected = generate(model, torch.tensor([ids]), max_new_tokens=5, eos_token_id=None)[0, len(ids):].tolist()
    assert gen.new_ids == expected and len(gen.step_seconds) == 4
    assert gen.cache_bytes == model.new_kv_cache(1, len(ids) + 5).nbytes  # 3 caches of a third of the heads
    with pytest.raises(ValueError, match="do not fit GPT-2's 1024 positions"):
        tp_generate(ranks, ids, n_new=1024)


def test_two_processes_generate_what_one_process_generates(gpt2):
    folder, model, ids = gpt2
    n_new, T = 4, len(ids)
    run = run_tensor_parallel(model, ids, n_new=n_new, world=2, sizes=[1, 768], repeats=2)
    expected = generate(model, torch.tensor([ids]), max_new_tokens=n_new, eos_token_id=None)[0, T:].tolist()
    assert run.new_ids == expected
    assert (run.prompt_logits - forward_once(model, torch.tensor([ids]))[0]).abs().max() < 1e-4
    assert len(run.collectives) == n_new and len(run.step_seconds) == len(run.collective_seconds) == n_new - 1
    for i, calls in enumerate(run.collectives):  # the prompt's pass, then one pass per new token after the first
        tokens = T if i == 0 else 1  # the KV cache: a decode step feeds one token
        assert [c.kind for c in calls] == ["all_reduce"] * 25 + ["all_gather"]  # the embedding, 2 per block, the head
        assert all(c.n_values == tokens * 768 and c.bytes_per_value == 4 for c in calls[:-1])
        assert calls[-1].n_values == tokens * 50304 // 2
    assert run.cache_bytes * 2 == model.new_kv_cache(1, T + n_new).nbytes  # rank 0's heads: half the cache
    assert set(run.all_reduce_seconds) == {1, 768} and all(s > 0 for s in run.all_reduce_seconds.values())
