"""Lesson 19's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
from types import SimpleNamespace

import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_19 import (PLANTED, check_bytes_sent, check_diagnosis, check_greedy_pick,
                                         planted_split)
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.tensor_parallel import Collective
from hardway.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    folder = checkpoint("openai-community/gpt2")
    model, tokenizer = load(folder), load_tokenizer(folder)
    return model, torch.tensor([tokenizer.encode("Tensor parallelism splits every layer")])


@pytest.fixture(scope="module")
def sol():
    return load_solutions("19_past_one_machine")


def test_check_greedy_pick(gpt2, sol):
    model, ids = gpt2
    assert check_greedy_pick(None, model, ids).startswith("not attempted yet")
    result = check_greedy_pick(sol.my_greedy_pick, model, ids)
    assert result.startswith("right"), result

    def pick(logits, vocab_start, all_gather, offset=True, last_on_tie=False):
        best, where = logits.max(dim=-1)
        sent = torch.stack([best, (where + vocab_start * offset).float()], dim=-1)
        gathered = torch.stack(all_gather(sent))  # (world, rows, 2)
        rank = (gathered.shape[0] - 1 - gathered[..., 0].flip(0).argmax(0) if last_on_tie
                else gathered[..., 0].argmax(0))
        return gathered[rank, torch.arange(rank.shape[0]), 1].long()

    def local_index(logits, vocab_start, all_gather):  # the winner's column in its own slice, not a token id
        return pick(logits, vocab_start, all_gather, offset=False)

    def last_rank_on_a_tie(logits, vocab_start, all_gather):  # `>=` in a running max: the later rank wins a tie
        return pick(logits, vocab_start, all_gather, last_on_tie=True)

    def gather_every_logit(logits, vocab_start, all_gather):  # right, but sends what tp_forward already sends
        return torch.cat(all_gather(logits), dim=-1).argmax(dim=-1)

    def no_collective(logits, vocab_start, all_gather):  # each rank's own best: the ranks disagree
        return logits.argmax(dim=-1) + vocab_start

    def not_implemented(logits, vocab_start, all_gather):
        raise NotImplementedError

    assert "an index inside a rank's slice: add that rank's vocab_start" in check_greedy_pick(local_index, model, ids)
    assert "a tie: one process's argmax takes the lowest id" in check_greedy_pick(last_rank_on_a_tie, model, ids)
    assert "the ids are right, but over 2 ranks a rank sent" in check_greedy_pick(gather_every_logit, model, ids)
    assert "the ranks returned different ids" in check_greedy_pick(no_collective, model, ids)
    assert check_greedy_pick(not_implemented, model, ids).startswith("not attempted yet")


def test_check_diagnosis(gpt2, sol):
    model, ids = gpt2
    planted_model, planted_ranks = planted_split(model)
    # The mistakes can be found with the lesson's tools: the solution's diagnose finds exactly PLANTED.
    assert sol.diagnose(planted_model, planted_ranks, ids) == PLANTED
    assert check_diagnosis(None).startswith("not attempted yet")
    result = check_diagnosis(sol.my_diagnosis)
    assert result.startswith("right"), result
    bias, heads = sol.my_diagnosis
    # Comparing hidden states along the sharded model's own stream finds only the first mistake.
    assert "you found 1 of 2" in check_diagnosis([bias])
    # Both places right, the faults swapped: a guess, not read off the difference.
    assert "is the place, but not 'heads'" in check_diagnosis([dict(bias, fault="heads"), dict(heads, fault="bias")])
    # A layer after a mistake differs too, but only because its input does.
    assert "layer 9's attention: its partial sums add up" in check_diagnosis([bias, dict(heads, layer=9)])
    assert check_diagnosis([{"layer": 3, "half": "MLP", "fault": "bias"}]).startswith("wrong: half 'MLP'")


def fake_run(n_layer=12, C=768, T=7, V=50257, world=2):
    """A TPRun's log as the two processes write it: 2L + 1 all-reduces of (tokens, C) and one all-gather of a rank's
    slice of the padded logits, for the prompt's pass and for a decode step."""
    def pass_log(tokens):
        return ([Collective("all_reduce", tokens * C, 4)] * (2 * n_layer + 1) +
                [Collective("all_gather", tokens * 50304 // world, 4)])
    return SimpleNamespace(prompt_logits=torch.zeros(T, V), collectives=[pass_log(T), pass_log(1)])


def test_check_bytes_sent(sol):
    assert check_bytes_sent(None).startswith("not attempted yet")
    assert check_bytes_sent(sol.my_bytes_sent).startswith("right")
    result = check_bytes_sent(sol.my_bytes_sent, fake_run())
    assert result.startswith("right") and "177,408 for a decode step" in result, result

    def blocks_only(L, C, V, T, w, b):  # the formula from before the vocabulary was split
        return 2 * L * 2 * (w - 1) / w * T * C * b

    def no_head(L, C, V, T, w, b):
        return (2 * L + 1) * 2 * (w - 1) / w * T * C * b

    def gather_as_all_reduce(L, C, V, T, w, b):  # the all-gather counted like an all-reduce
        return ((2 * L + 1) * T * C + T * V) * 2 * (w - 1) / w * b

    def whole_tensor_each_time(L, C, V, T, w, b):  # no ring: the full tensor from every rank
        return ((2 * L + 1) * T * C + T * V) * b

    def the_mlps_width(L, C, V, T, w, b):
        return sol.my_bytes_sent(L, 4 * C, V, T, w, b)

    assert "only the blocks are counted" in check_bytes_sent(blocks_only)
    assert "the head's all-gather is missing" in check_bytes_sent(no_head)
    assert "an all-gather sends (w - 1)/w of the gathered whole" in check_bytes_sent(gather_as_all_reduce)
    assert "a ring sends a fraction of each tensor" in check_bytes_sent(whole_tensor_each_time)
    assert "the residual stream, (tokens, C), not the MLP's 4C" in check_bytes_sent(the_mlps_width)
    # A log with one all-reduce more than the formula counts: the check reads the log, not the formula alone.
    extra = fake_run()
    extra.collectives[-1] = extra.collectives[-1][:1] + extra.collectives[-1]
    assert "a decode step of the two processes logged" in check_bytes_sent(sol.my_bytes_sent, extra)
