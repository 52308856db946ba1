"""Lesson 19's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear."""
import pytest
import torch

from exercise_solutions import load_solutions
from hardway.exercises.lesson_19 import (PLANTED, check_diagnosis, check_greedy_pick, check_rank_bytes,
                                         planted_split)
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


def test_check_rank_bytes(gpt2, sol):
    model, _ = gpt2
    assert check_rank_bytes(None, model).startswith("not attempted yet")
    verdict = check_rank_bytes(sol.my_rank_bytes, model)
    assert verdict.startswith("right") and "on rank 0" in verdict, verdict

    def parts(config, rank, world):  # the right count, by kind, for the wrong ones to change
        C, L, D = config.n_embd, config.n_layer, config.d_mlp
        return dict(vocab=-(-config.vocab_size // 64) * 64 // world * C, wpe=config.n_positions * C,
                    norms=(2 * L + 1) * 2 * C, split=L * (4 * C * C + 2 * D * C + 3 * C + D) // world,
                    row_biases=2 * L * C if rank == 0 else 0)

    def counted(**changes):
        def count(config, rank, world):
            p = parts(config, rank, world)
            for kind, change in changes.items():
                p[kind] = change(p[kind], config, world)
            return 4 * sum(p.values())
        return count

    wrong_answers = {
        "the layer norms are whole": counted(norms=lambda v, c, w: v // w),
        "the position embedding is whole": counted(wpe=lambda v, c, w: 0),
        "padded to a multiple of 64": counted(vocab=lambda v, c, w: c.vocab_size * c.n_embd // w),
        "tied": counted(vocab=lambda v, c, w: 2 * v),
        "on rank 0 alone": counted(row_biases=lambda v, c, w: 2 * c.n_layer * c.n_embd),  # on every rank
        "only the blocks' matrices": lambda c, r, w: 4 * c.n_layer * (4 * c.n_embd ** 2 + 2 * c.d_mlp * c.n_embd) // w,
        "everything divided by the world": lambda c, r, w: 4 * sum(parts(c, 0, 1).values()) // w,
    }
    for words, wrong in wrong_answers.items():
        verdict = check_rank_bytes(wrong, model)
        assert verdict.startswith("wrong:") and "its shards measure" in verdict, (words, verdict)
        if words != "everything divided by the world":  # no single slip: the general hint
            assert words in verdict, (words, verdict)
    assert "which only rank 0 has" in check_rank_bytes(wrong_answers["everything divided by the world"], model)
