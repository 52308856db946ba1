"""Lesson 19's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch
import torch.nn.functional as F

from exercise_solutions import load_solutions
from hardway.exercises.lesson_19 import check_bytes_sent, check_mlp_partial, check_shard_qkv
from hardway.models.gpt2 import gelu_tanh
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    folder = checkpoint("openai-community/gpt2")
    model, tokenizer = load(folder), load_tokenizer(folder)
    return model, torch.tensor([tokenizer.encode("Tensor parallelism splits every layer")])


@pytest.fixture(scope="module")
def sol():
    return load_solutions("19_past_one_machine")


def test_check_shard_qkv(gpt2, sol):
    model, ids = gpt2
    assert check_shard_qkv(None, model, ids).startswith("not attempted yet")
    result = check_shard_qkv(sol.my_shard_qkv, model, ids)
    assert result.startswith("right"), result

    def one_third(weight, bias, rank, world):  # a contiguous slice of all 3C rows: q's heads on rank 0, v's on the last
        return weight.chunk(world)[rank], bias.chunk(world)[rank]

    def bias_uncut(weight, bias, rank, world):
        return sol.my_shard_qkv(weight, bias, rank, world)[0], bias

    def every_other_head(weight, bias, rank, world):  # heads r, r + w, ...: c_proj's columns are cut contiguously
        C, d = weight.shape[1], 64
        heads = range(rank, C // d, world)
        rows = torch.cat([torch.arange(p * C + h * d, p * C + (h + 1) * d) for p in range(3) for h in heads])
        return weight[rows], bias[rows]

    assert "[all of q | all of k | all of v]" in check_shard_qkv(one_third, model, ids)
    assert check_shard_qkv(bias_uncut, model, ids).startswith("wrong: rank 0 of 2: the bias has shape (2304,)")
    assert check_shard_qkv(every_other_head, model, ids).startswith("wrong: rank 0 of 2: the weight rows differ")


def test_check_mlp_partial(gpt2, sol):
    model, ids = gpt2
    assert check_mlp_partial(None, model, ids).startswith("not attempted yet")
    result = check_mlp_partial(sol.my_mlp_partial, model, ids)
    assert result.startswith("right"), result

    def bias_on_every_rank(shard, x):
        return sol.my_mlp_partial(shard, x) + shard.fc_proj_bias

    def gelu_after_the_projection(shard, x):  # GELU of a partial sum is not a partial sum of GELU
        return gelu_tanh(F.linear(F.linear(x, shard.fc_weight, shard.fc_bias), shard.fc_proj_weight))

    def hidden_units_not_reduced(shard, x):  # the hidden units, not the projection back to C
        return gelu_tanh(F.linear(x, shard.fc_weight, shard.fc_bias))

    assert "every rank added c_proj's bias, so the sum holds it 2 times" in check_mlp_partial(bias_on_every_rank,
                                                                                             model, ids)
    assert "each rank's hidden units go through GELU on their own" in check_mlp_partial(gelu_after_the_projection,
                                                                                        model, ids)
    assert "should be a tensor of shape (1, 7, 768), got (1, 7, 1536)" in check_mlp_partial(hidden_units_not_reduced,
                                                                                            model, ids)


def test_check_bytes_sent(sol):
    assert check_bytes_sent(None).startswith("not attempted yet")
    assert check_bytes_sent(sol.my_bytes_sent).startswith("right")

    def once_per_block(n_layer, n_embd, n_tokens, world, size):
        return sol.my_bytes_sent(n_layer, n_embd, n_tokens, world, size) / 2

    def whole_tensor_each_time(n_layer, n_embd, n_tokens, world, size):  # no ring: the full tensor from every rank
        return 2 * n_layer * n_tokens * n_embd * size

    def the_mlps_width(n_layer, n_embd, n_tokens, world, size):
        return sol.my_bytes_sent(n_layer, 4 * n_embd, n_tokens, world, size)

    assert "a block reduces twice" in check_bytes_sent(once_per_block)
    assert "a ring all-reduce sends 2(w - 1)/w of the tensor" in check_bytes_sent(whole_tensor_each_time)
    assert "the residual stream, (tokens, C), not the MLP's 4C" in check_bytes_sent(the_mlps_width)
