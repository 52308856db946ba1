"""Serving many requests at once: a paged KV cache, a block manager, and a continuous-batching engine.

    engine = Engine(model, tokenizer, n_blocks=256, block_size=16, max_batch=16)
    engine.add(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work():
        for event in engine.step(): ...   # each running sequence's new text, and which ones finished

The models need no paged-attention code of their own: `PagedKVCache.update` has the KVCache interface (lesson 08),
and returns the batch's keys and values gathered from the blocks as a left-padded batch (lesson 13), whose
attention mask the engine passes to the model.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import torch

from hardway.loading import CausalLM
from hardway.sampling import build_processors, sample_next_token


class PoolTooSmallError(ValueError):
    """A request that needs more blocks than the whole pool holds: it could never run, so it is refused."""


class BlockManager:
    """Hands out fixed-size blocks of KV-cache positions from a free list; a sequence's block table lists its blocks.

    Position p of a sequence lives in block block_table[p // block_size], at offset p % block_size: memory is
    claimed one block at a time as the sequence grows, and returned the moment it finishes."""

    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free_blocks = deque(range(n_blocks))  # ids of the blocks nobody holds

    @property
    def n_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, n_positions: int) -> int:
        """How many blocks hold n_positions positions: the last one may be partly empty."""
        return math.ceil(n_positions / self.block_size)

    def grow(self, block_table: list[int], n_positions: int) -> bool:
        """Append blocks to block_table until it holds n_positions; False (and nothing taken) if too few are free."""
        missing = self.blocks_for(n_positions) - len(block_table)
        if missing > self.n_free:
            return False
        block_table.extend(self.free_blocks.popleft() for _ in range(max(missing, 0)))
        return True

    def release(self, block_table: list[int]) -> None:
        """Give every block of a table back to the pool, and empty the table."""
        self.free_blocks.extend(block_table)
        block_table.clear()


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Where position `position` of a sequence lives in the pool, counted in positions: block * block_size + offset."""
    return block_table[position // block_size] * block_size + position % block_size


class PagedKVCache:
    """The keys and values of many sequences in one pool of blocks, one pool per layer.

    k, v: (n_layers, n_blocks * block_size, n_kv_heads, head_dim): slot s of the pool is position s % block_size of
    block s // block_size. Before each forward pass, `bind` says which sequences the batch's rows are and how many
    positions each already has; `update` then has KVCache's interface: it writes each row's new keys/values into
    that sequence's blocks and returns the batch's keys/values, gathered through the block tables and left-padded
    to the longest row, (B, n_kv_heads, S, head_dim). `attention_mask` (B, S) marks each row's real positions."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        self.n_layers, self.block_size, self.n_kv_heads, self.head_dim = n_layers, block_size, n_kv_heads, head_dim
        shape = (n_layers, n_blocks * block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (n_layers, n_slots, n_kv_heads, head_dim)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (n_layers, n_slots, n_kv_heads, head_dim)
        self.device = device

    @classmethod
    def for_model(cls, model: CausalLM, n_blocks: int, block_size: int) -> PagedKVCache:
        """A pool shaped like the model's own KVCache (same layers, KV heads, head size, dtype, device)."""
        probe = model.new_kv_cache(1, 1)  # lesson 08's cache, one position: it knows the model's shapes
        return cls(probe.n_layers, n_blocks, block_size, probe.n_kv_heads, probe.head_dim, probe.k.dtype,
                   probe.k.device)

    def bind(self, block_tables: list[list[int]], n_cached: list[int], n_new: int) -> torch.Tensor | None:
        """Prepare the next forward pass: row i is the sequence with `block_tables[i]`, which has n_cached[i]
        positions in the pool and receives n_new new ones. Returns the attention mask (B, S), S = max(n_cached) +
        n_new, or None when no row needs padding. The model is then called with start_pos = max(n_cached)."""
        S = max(n_cached) + n_new
        bs = self.block_size
        write, read = [], []  # write: (B * n_new,) slots of the new positions; read: (B, S) slots, padding first
        for table, n in zip(block_tables, n_cached):
            slots = [slot_of(table, p, bs) for p in range(n + n_new)]
            write.extend(slots[n:])
            read.append([0] * (S - len(slots)) + slots)  # padding reads slot 0: any slot will do, it is masked out
        self.write_slots = torch.tensor(write, device=self.device)  # (B * n_new,)
        self.read_slots = torch.tensor(read, device=self.device)  # (B, S)
        self.batch_size, self.n_new = len(block_tables), n_new
        real = torch.tensor([[0] * (S - n - n_new) + [1] * (n + n_new) for n in n_cached], device=self.device)
        return None if bool(real.all()) else real  # (B, S): 1 where the row has a real position

    def update(self, layer_idx: int, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        """k, v (B, n_kv_heads, n_new, head_dim) -> the rows' keys and values so far, each (B, n_kv_heads, S, d)."""
        B, H, T, d = k.shape
        if (B, T) != (self.batch_size, self.n_new):
            raise ValueError(f"PagedKVCache.update: got {B} rows of {T} new positions, but bind() prepared "
                             f"{self.batch_size} rows of {self.n_new}")
        self.k[layer_idx, self.write_slots] = k.transpose(1, 2).reshape(B * T, H, d)  # scatter into the blocks
        self.v[layer_idx, self.write_slots] = v.transpose(1, 2).reshape(B * T, H, d)
        keys = self.k[layer_idx, self.read_slots]  # (B, S, n_kv_heads, d): gathered through the block tables
        values = self.v[layer_idx, self.read_slots]  # (B, S, n_kv_heads, d)
        return keys.transpose(1, 2), values.transpose(1, 2)  # each (B, n_kv_heads, S, d)


@dataclass
class SamplingParams:
    """What a request asks for; the server checks the values before they get here."""
    max_tokens: int = 16
    temperature: float = 1.0       # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings: the text ends before the first one
    stop_token_ids: list[int] | None = None        # None = the model's EOS ids


_seq_ids = itertools.count()


@dataclass(eq=False)  # a sequence is itself, not equal to another with the same fields
class Sequence:
    """One request inside the engine: its tokens, its blocks, and how far it got."""
    prompt_ids: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_seq_ids))
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    n_cached: int = 0                 # positions whose keys/values are in the pool
    text: str = ""                    # the output text so far, up to any stop string
    n_sent: int = 0                   # characters of `text` already handed out (streaming)
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    n_preemptions: int = 0
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class Event:
    """What one engine step produced for one sequence: new text, and whether it finished."""
    seq: Sequence
    text: str
    finished: bool


def apply_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cut text before the first stop string it contains: (text, True), or (text, False) when none occurs."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class Engine:
    """Continuous batching: every `step` admits waiting sequences (prefilled one at a time), decodes all running
    sequences as one batch, and finishes and frees the ones that are done. When the pool runs out, the newest
    running sequence is preempted: its blocks are freed and it waits to be recomputed from its tokens later."""

    def __init__(self, model: CausalLM, tokenizer, n_blocks: int = 256, block_size: int = 16, max_batch: int = 16,
                 max_prefill_tokens: int = 2048):
        self.model, self.tokenizer = model, tokenizer
        self.blocks = BlockManager(n_blocks, block_size)
        self.cache = PagedKVCache.for_model(model, n_blocks, block_size)
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()  # first come, first served
        self.running: list[Sequence] = []        # in the order they were admitted: the last is the newest
        self.n_preemptions = 0
        self.device = self.cache.device

    def capacity(self) -> int:
        """The most positions one sequence can ever hold here: the model's context, or the whole pool if smaller."""
        return min(self.model.max_seq_len, self.blocks.n_blocks * self.blocks.block_size)

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request. Refused at once (PoolTooSmallError) if prompt + max_tokens could never fit."""
        need = len(prompt_ids) + params.max_tokens
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        if need > self.capacity():
            raise PoolTooSmallError(f"the prompt's {len(prompt_ids)} tokens + max_tokens {params.max_tokens} = {need} "
                                    f"positions, more than this engine can hold for one sequence ({self.capacity()})")
        seq = Sequence(list(prompt_ids), params)
        if params.temperature > 0 and params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (a client went away): its blocks go back to the pool at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table)
        seq.finish_reason = seq.finish_reason or "abort"

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Event]:
        """One scheduler iteration: admit and prefill waiting sequences, then one decode step for the running batch.
        Each sequence gets at most one new token per step."""
        events = []
        budget = self.max_prefill_tokens
        decoding = list(self.running)  # admitted in earlier steps: their last token is not in the cache yet
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            n = len(seq.tokens)
            if (n > budget and budget < self.max_prefill_tokens) or not self.blocks.grow(seq.block_table, n):
                break  # no room now: it stays first in line
            self.waiting.popleft()
            budget -= n
            logits = self._forward([seq], torch.tensor([seq.tokens], device=self.device))  # (1, 1, V)
            self.running.append(seq)
            events.append(self._accept(seq, logits[0, -1]))
            if seq.finish_reason is not None:  # done at its first token
                self._finish(seq)
        for seq in decoding:  # room for one more position each; when the pool is empty, preempt the newest
            while seq in self.running and not self.blocks.grow(seq.block_table, seq.n_cached + 1):
                self._preempt(self.running[-1])  # the newest: it has the least work to redo
        decoding = [s for s in decoding if s in self.running]
        if decoding:
            last = torch.tensor([[s.tokens[-1]] for s in decoding], device=self.device)  # (B, 1)
            logits = self._forward(decoding, last)  # (B, 1, V)
            events += [self._accept(s, logits[i, -1]) for i, s in enumerate(decoding)]
        for s in decoding:
            if s.finish_reason is not None:
                self._finish(s)
        return events

    def _finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)  # free at once: the next step can use them

    def _forward(self, seqs: list[Sequence], input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T): the next T tokens of each sequence -> logits (B, 1, V) of each row's last position."""
        n_cached = [s.n_cached for s in seqs]
        mask = self.cache.bind([s.block_table for s in seqs], n_cached, input_ids.shape[1])  # (B, S) or None
        padding = {} if mask is None else {"attention_mask": mask}
        with torch.inference_mode():
            logits = self.model(input_ids, kv_cache=self.cache, start_pos=max(n_cached), last_only=True, **padding)
        for s in seqs:
            s.n_cached += input_ids.shape[1]
        return logits  # (B, 1, V)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and put it first in line; it is recomputed from its tokens later."""
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.n_cached = 0
        seq.n_preemptions += 1
        self.n_preemptions += 1
        self.waiting.appendleft(seq)

    def _accept(self, seq: Sequence, logits: torch.Tensor) -> Event:
        """Pick the next token from one row's logits (V,), as generate() does, and decide if the sequence is done."""
        p = seq.params
        do_sample = p.temperature > 0
        processors = build_processors(do_sample, p.temperature if do_sample else None, None,
                                      p.top_p if do_sample else None)
        scores = processors(torch.tensor([seq.tokens], device=self.device), logits.float()[None])  # (1, V)
        token = int(sample_next_token(scores, do_sample, seq.generator)[0])
        stop_ids = self.model.eos_token_ids if p.stop_token_ids is None else p.stop_token_ids
        if token in stop_ids:
            seq.finish_reason = "stop"  # the end-of-sequence token itself is not part of the text
        else:
            seq.output_ids.append(token)
            text, stopped = apply_stop(self.tokenizer.decode(seq.output_ids), p.stop)
            seq.text = text
            if stopped:
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens:
                seq.finish_reason = "length"
        finished = seq.finish_reason is not None
        return Event(seq, self._new_text(seq, finished), finished)

    def _new_text(self, seq: Sequence, finished: bool) -> str:
        """The text not handed out yet. Held back while it could still be the start of a stop string, or ends in
        half a UTF-8 character (decoded as U+FFFD); everything once the sequence finishes."""
        end = len(seq.text)
        if not finished:
            if seq.text.endswith("\ufffd"):
                end -= 1
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)
            end = max(seq.n_sent, end - hold)
        new, seq.n_sent = seq.text[seq.n_sent:end], max(seq.n_sent, end)
        return new

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Run prompts to completion together (no server): the sequences, finished, in the order given."""
        seqs = [self.add(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return seqs
