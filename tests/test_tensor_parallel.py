"""Lesson 19's tensor parallelism: GPT-2 split over ranks gives the whole model's logits (simulated in one process,
over 2, 3 and 4 ranks), and two real processes (gloo on 127.0.0.1) generate the same greedy tokens as one, with two
all-reduces per block per forward pass."""
import copy

import pytest
import torch

from hardway.decode.generate import generate
from hardway.formats.hub import checkpoint
from hardway.loading import forward_once, load
from hardway.tensor_parallel import (attention_partial, check_divisible, mlp_partial, run_tensor_parallel, shard_block, shard_gpt2, tp_forward)
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
        attn = sum(attention_partial(s, block.ln_1(x)) for s in shards) + shards[0].proj_bias
        mlp = sum(mlp_partial(s, block.ln_2(x)) for s in shards) + shards[0].fc_proj_bias
        assert (attn - block.attn(block.ln_1(x))).abs().max() < 1e-5
        assert (mlp - block.mlp(block.ln_2(x))).abs().max() < 1e-5
        assert shards[0].qkv_weight.shape == (3 * 768 // world, 768) and shards[0].fc_weight.shape == (3072 // world, 768)


def test_simulated_ranks_give_the_whole_models_logits(gpt2):
    _, model, ids = gpt2
    whole = forward_once(model, torch.tensor([ids]))
    for world in (2, 3, 4):
        ranks = [shard_gpt2(model, r, world) for r in range(world)]
        assert (tp_forward(model, ranks, torch.tensor([ids])) - whole).abs().max() < 1e-4


def test_heads_that_do_not_split_evenly_are_refused():
    with pytest.raises(ValueError, match="9 attention heads and 1536 MLP units do not split evenly over 2 ranks"):
        check_divisible(9, 1536, 2)  # SmolLM2-135M over 2 ranks: vLLM refuses it too
    check_divisible(9, 1536, 3)


def test_two_processes_generate_what_one_process_generates(gpt2):
    folder, model, ids = gpt2
    n_new = 4
    run = run_tensor_parallel(folder, ids, n_new=n_new, world=2)
    assert run.new_ids == generate(model, torch.tensor([ids]), max_new_tokens=n_new)[0, len(ids):].tolist()
    assert (run.prompt_logits - forward_once(model, torch.tensor([ids]))[0]).abs().max() < 1e-4
    passes = [len(ids)] + [len(ids) + i for i in range(n_new)]  # the prompt's pass, then one per new token
    assert run.n_all_reduces == len(passes) * 2 * 12  # two per block of GPT-2's 12, per pass
    assert run.bytes_reduced == sum(T * 768 * 4 for T in passes) * 2 * 12  # each the (T, C) fp32 residual stream
