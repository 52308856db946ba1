"""Lesson 14's exercise checks: each passes the reference solution, says "not attempted" for None, and fails
plausible wrong answers, for the reason a learner would need to hear. Every check runs the real engine (GPT-2
stand-in) with the learner's piece in place."""

import pytest

from hardway.formats.hub import checkpoint
from hardway.exercises.lesson_14 import (check_batching_work, check_block_manager, check_schedule,
                                         check_tokens_this_step)
from hardway.loading import load
from hardway.engine.scheduler import ScheduledBatch
from hardway.text.tokenizer import load_tokenizer
from exercise_solutions import load_solutions


@pytest.fixture(scope="module")
def gpt2():
    folder = checkpoint("openai-community/gpt2")
    return load(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def sol():
    return load_solutions("14_serving")


def test_check_block_manager(gpt2, sol):
    model, tok = gpt2
    assert check_block_manager(None, model, tok).startswith("not attempted yet")
    result = check_block_manager(sol.MyBlockManager, model, tok)
    assert result.startswith("right"), result

    class TakesBeforeChecking(sol.MyBlockManager):  # grows the table block by block, then finds it cannot finish
        def grow(self, block_table, n_positions):
            while len(block_table) * self.block_size < n_positions:
                if not self.free_blocks:
                    return False
                block_table.append(self.free_blocks.popleft())
            return True

    class KeepsTheTable(sol.MyBlockManager):  # gives the blocks back but the sequence still lists them
        def release(self, block_table):
            self.free_blocks.extend(block_table)

    class AllocatesAFreshTable(sol.MyBlockManager):  # takes blocks for every position, not only the missing ones
        def grow(self, block_table, n_positions):
            need = -(-n_positions // self.block_size)
            if need > len(self.free_blocks):
                return False
            block_table.extend(self.free_blocks.popleft() for _ in range(need))
            return True

    wrong = check_block_manager(TakesBeforeChecking, model, tok)
    assert wrong.startswith("wrong") and "take nothing" in wrong, wrong
    wrong = check_block_manager(KeepsTheTable, model, tok)
    assert wrong.startswith("wrong") and "release(table)" in wrong, wrong
    wrong = check_block_manager(AllocatesAFreshTable, model, tok)
    assert wrong.startswith("wrong") and "needs no new block" in wrong, wrong

    class ReleasesEveryOtherBlock(sol.MyBlockManager):  # passes the small cases, loses blocks in the engine
        def release(self, block_table):
            if len(block_table) == 3:
                return super().release(block_table)
            self.free_blocks.extend(block_table[::2])
            block_table.clear()

    wrong = check_block_manager(ReleasesEveryOtherBlock, model, tok)
    assert wrong.startswith("wrong: in the engine"), wrong


def _schedule_variant(*, admit_first=False, victim=lambda running: running[-1], admit_after_preemption=False):
    """The reference decision with one thing changed, as a learner might write it."""
    def schedule(scheduler):
        batch = ScheduledBatch()
        budget = scheduler.max_step_tokens

        def admit():
            nonlocal budget
            while scheduler.waiting and len(scheduler.running) < scheduler.max_batch and budget > 0:
                seq = scheduler.waiting[0]
                n = scheduler.tokens_this_step(seq, budget)
                if not scheduler.blocks.grow(seq.block_table, seq.n_cached + n):
                    break
                scheduler.admit_first()
                batch.add(seq, n)
                batch.admitted.append(seq)
                budget -= n

        if admit_first:
            admit()
        for seq in list(scheduler.running):
            if seq not in scheduler.running or seq in batch.seqs:
                continue
            n = scheduler.tokens_this_step(seq, budget)
            if n == 0:
                continue
            while not scheduler.blocks.grow(seq.block_table, seq.n_cached + n):
                v = victim(scheduler.running)
                scheduler.preempt(v)
                batch.preempted.append(v)
                if v in batch.seqs:
                    i = batch.seqs.index(v)
                    del batch.seqs[i], batch.n_new[i]
                if v is seq:
                    break
            else:
                batch.add(seq, n)
                budget -= n
        if not admit_first and (admit_after_preemption or not batch.preempted):
            admit()
        return batch
    return schedule


def test_check_schedule(gpt2, sol):
    model, tok = gpt2
    assert check_schedule(None, model, tok).startswith("not attempted yet")
    result = check_schedule(sol.my_schedule, model, tok)
    assert result.startswith("right"), result
    assert check_schedule(_schedule_variant(), model, tok).startswith("right")  # the variant machinery is sound
    wrong = check_schedule(_schedule_variant(admit_first=True), model, tok)
    assert wrong.startswith("wrong") and "preempted in the step that admitted it" in wrong, wrong
    wrong = check_schedule(_schedule_variant(admit_after_preemption=True), model, tok)
    assert wrong.startswith("wrong") and "and then admitted" in wrong, wrong
    wrong = check_schedule(_schedule_variant(victim=lambda running: running[0]), model, tok)  # the oldest
    assert wrong.startswith("wrong") and "arrived after it" in wrong, wrong

    def only_admits(scheduler):  # forgets the running sequences: they never get their next token
        batch = ScheduledBatch()
        while scheduler.waiting and scheduler.blocks.grow(scheduler.waiting[0].block_table,
                                                          len(scheduler.waiting[0].tokens)):
            seq = scheduler.admit_first()
            batch.add(seq, seq.n_uncomputed)
            batch.admitted.append(seq)
        return batch

    wrong = check_schedule(only_admits, model, tok)
    assert wrong.startswith("wrong") and "left out of a step" in wrong, wrong


def test_check_tokens_this_step(gpt2, sol):
    model, tok = gpt2
    assert check_tokens_this_step(None, model, tok).startswith("not attempted yet")
    result = check_tokens_this_step(sol.my_tokens_this_step, model, tok)
    assert result.startswith("right"), result
    prompt_only = lambda seq, budget: min(len(seq.prompt_ids) - seq.n_cached, budget)  # forgets generated tokens
    wrong = check_tokens_this_step(prompt_only, model, tok)
    assert wrong.startswith("wrong") and "decoding" in wrong, wrong
    ignores_cache = lambda seq, budget: min(len(seq.tokens), budget)  # recomputes what is in the pool
    wrong = check_tokens_this_step(ignores_cache, model, tok)
    assert wrong.startswith("wrong") and "8 already computed" in wrong, wrong
    no_budget = lambda seq, budget: len(seq.tokens) - seq.n_cached  # the whole prompt whatever the budget
    wrong = check_tokens_this_step(no_budget, model, tok)
    assert wrong.startswith("wrong") and "budget of 4" in wrong, wrong
    forgets_outputs_after_preemption = lambda seq, budget: (min(len(seq.prompt_ids), budget) if seq.n_cached == 0
                                                             else min(len(seq.tokens) - seq.n_cached, budget))
    wrong = check_tokens_this_step(forgets_outputs_after_preemption, model, tok)
    assert wrong.startswith("wrong") and "preempted" in wrong, wrong


def test_check_batching_work(gpt2, sol):
    model, tokenizer = gpt2
    assert check_batching_work(None, model, tokenizer).startswith("not attempted yet")
    verdict = check_batching_work(sol.my_positions, model, tokenizer)
    assert verdict.startswith("right") and "fewer" in verdict, verdict

    def rows_stop_when_done(prompt_lens, wants, batch_size):  # static rows taken to stop at their own max_tokens
        static = sum(max(prompt_lens[f:f + batch_size]) + n - 1 for f in range(0, len(wants), batch_size)
                     for n in wants[f:f + batch_size])
        return static, sol.my_positions(prompt_lens, wants, batch_size)[1]

    def no_padding(prompt_lens, wants, batch_size):
        static = sum(p + max(wants[f:f + batch_size]) - 1 for f in range(0, len(wants), batch_size)
                     for p in prompt_lens[f:f + batch_size])
        return static, sol.my_positions(prompt_lens, wants, batch_size)[1]

    def last_token_fed_back(prompt_lens, wants, batch_size):
        static, continuous = sol.my_positions(prompt_lens, wants, batch_size)
        return static + len(wants), continuous + len(wants)

    for wrong, words in ((rows_stop_when_done, "its answer finished or not"), (no_padding, "padding is computed"),
                         (last_token_fed_back, "never fed back"),
                         (lambda p, n, b: sum(p) + sum(n), "return a pair")):
        verdict = check_batching_work(wrong, model, tokenizer)
        assert verdict.startswith("wrong:") and words in verdict, (getattr(wrong, "__name__", wrong), verdict)
