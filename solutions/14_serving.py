"""Reference solutions to lesson 14's exercises (notebooks/14_serving.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
from hardway.engine.block_manager import BlockManager
from hardway.engine.scheduler import ScheduledBatch


# Exercise 1: the block manager's allocate and free.
class MyBlockManager(BlockManager):
    def grow(self, block_table, n_positions):
        missing = -(-n_positions // self.block_size) - len(block_table)  # blocks still needed (ceil division)
        if missing > len(self.free_blocks):
            return False  # refuse before taking anything: a half-grown table would hold blocks nobody can use
        for _ in range(max(missing, 0)):
            block_table.append(self.free_blocks.popleft())
        return True

    def release(self, block_table):
        self.free_blocks.extend(block_table)
        block_table.clear()  # the sequence holds nothing now: releasing it again gives nothing back twice


# Exercise 2: the scheduler's decision.
def my_schedule(scheduler):
    batch = ScheduledBatch()
    budget = scheduler.max_step_tokens
    for seq in list(scheduler.running):  # running sequences first, oldest first
        if seq not in scheduler.running:  # already preempted in this step, to make room for an older one
            continue
        n = scheduler.tokens_this_step(seq, budget)
        if n == 0:
            continue
        while not scheduler.blocks.grow(seq.block_table, seq.n_cached + n):
            victim = scheduler.running[-1]  # the latest arrival
            scheduler.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                break
        else:
            batch.add(seq, n)
            budget -= n
    if not batch.preempted:  # admit only when the pool was not short
        while scheduler.waiting and len(scheduler.running) < scheduler.max_batch and budget > 0:
            seq = scheduler.waiting[0]
            n = scheduler.tokens_this_step(seq, budget)
            if not scheduler.blocks.grow(seq.block_table, seq.n_cached + n):
                break
            scheduler.admit_first()
            batch.add(seq, n)
            batch.admitted.append(seq)
            budget -= n
    return batch


# Exercise 3: a prompt under the step's budget.
def my_tokens_this_step(seq, budget):
    uncomputed = len(seq.prompt_ids) + len(seq.output_ids) - seq.n_cached  # after a preemption: everything again
    return min(uncomputed, budget)


# Exercise 4: the positions each way of batching computes. Static: groups of batch_size in arrival order, every row
# padded to its group's longest prompt and run for its group's longest answer; a row computes its padded prompt, then
# one position a step for every new token but the last (sampled, never fed back). Continuous: each request its own
# prompt and its own answer, nothing more.
def my_positions(prompt_lens, wants, batch_size):
    static = 0
    for first in range(0, len(wants), batch_size):
        rows = range(first, min(first + batch_size, len(wants)))
        static += len(rows) * (max(prompt_lens[i] for i in rows) + max(wants[i] for i in rows) - 1)
    continuous = sum(p + n - 1 for p, n in zip(prompt_lens, wants))
    return static, continuous
