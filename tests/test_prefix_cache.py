"""Lesson 15's prefix cache: greedy answers token-identical with and without it (fp32, both stand-ins), when a
request hits a prefix that another is still decoding after, when a sequence is preempted while it holds shared
blocks, and when cached blocks are evicted from a tiny pool; every reference count back to zero after each test."""

import pytest
import torch

import hardway.server.launch
from hardway import cli
from hardway.decode.generate import generate
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.engine.block_manager import PrefixCachingBlockManager, block_key
from hardway.engine.config import EngineConfig
from hardway.engine.engine import PrefixCachingEngine
from hardway.server.worker import EngineThread
from hardway.engine.engine import Engine
from hardway.engine.sequence import SamplingParams, Sequence
from hardway.engine.scheduler import Scheduler
from hardway.text.tokenizer import load_tokenizer

SYSTEM = "You are a careful assistant who answers in one short sentence and says so when unsure. "
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What is the capital of France?",
             "Why is the sky blue?", "What is two plus two?"]
N_NEW = 8
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0, stop_token_ids=[])  # N_NEW tokens each, past any EOS


def all_released(blocks: PrefixCachingBlockManager) -> bool:
    return not any(blocks.ref_counts) and blocks.n_free == blocks.n_blocks


def test_block_keys_name_the_whole_prefix():
    k1 = block_key(b"", [1, 2, 3, 4])
    assert k1 == block_key(b"", [1, 2, 3, 4]) and len(k1) == 32
    assert block_key(k1, [5, 6, 7, 8]) != block_key(block_key(b"", [9, 9, 9, 9]), [5, 6, 7, 8])
    assert block_key(b"", [1, 2, 3, 4]) != block_key(b"", [4, 3, 2, 1])
    assert block_key(b"", [1, 2, 3, 4]) != block_key(b"", [1, 2, 3, 4 + 2**32])  # 8 bytes per id, not 4


def computed(blocks, tokens) -> Sequence:
    """A sequence holding blocks for all its tokens, every position computed and its full blocks keyed."""
    seq = Sequence(list(tokens), SamplingParams())
    seq.n_cached = blocks.share_prefix(seq)
    assert blocks.grow(seq.block_table, len(tokens))
    seq.n_cached = len(tokens)
    blocks.cache_blocks(seq)
    return seq


def test_block_manager_shares_counts_and_evicts_least_recently_used():
    blocks = PrefixCachingBlockManager(n_blocks=8, block_size=4)
    a = computed(blocks, range(14))  # 3 full blocks + 1 partial
    b = Sequence(list(range(12)), SamplingParams())  # a's first three blocks exactly
    assert blocks.share_prefix(b) == 8 and b.block_table == a.block_table[:2]  # the last token is left to compute
    assert [blocks.ref_counts[x] for x in a.block_table] == [2, 2, 1, 1]
    a_table = list(a.block_table)
    blocks.release(a.block_table)
    assert [blocks.ref_counts[x] for x in a_table] == [1, 1, 0, 0]
    assert list(blocks.evictable) == [a_table[2]] and a_table[3] in blocks.free_blocks  # the partial block: free
    blocks.release(b.block_table)
    assert list(blocks.evictable) == [a_table[2], a_table[1], a_table[0]]  # tail first: evicted first
    c = computed(blocks, range(100, 124))  # 6 blocks: 5 free, then the least recently used cached one
    assert blocks.n_evictions == 1 and a_table[2] in c.block_table
    assert blocks.match_prefix(list(range(14))) == a_table[:2]  # the head is still found; the evicted tail is not
    blocks.release(c.block_table)
    assert all_released(blocks)


def test_a_copy_is_cached_when_the_block_it_copies_is_evicted():
    """Two sequences compute the same prefix at once: the second's blocks are copies, not the ones found. If the
    originals are evicted while the copies are held, releasing a copy caches it (it used to raise KeyError)."""
    blocks = PrefixCachingBlockManager(n_blocks=6, block_size=4)
    a, b = Sequence(list(range(9)), SamplingParams()), Sequence(list(range(9)), SamplingParams())
    for seq in (a, b):  # both admitted before either computed anything: no hit
        assert blocks.share_prefix(seq) == 0 and blocks.grow(seq.block_table, 9)
    for seq in (a, b):
        seq.n_cached = 9
        blocks.cache_blocks(seq)
    assert blocks.cached[blocks.key_of[a.block_table[0]]] == a.block_table[0]
    a_table, b_table = list(a.block_table), list(b.block_table)
    blocks.release(a.block_table)  # a's two full blocks evictable, its partial one free
    big = Sequence(list(range(50, 62)), SamplingParams())
    assert blocks.grow(big.block_table, 12) and blocks.n_evictions == 2  # the free block, then both of a's
    blocks.release(big.block_table)
    blocks.release(b.block_table)
    assert blocks.match_prefix(list(range(9))) == b_table[:2]  # b's copies are now the blocks found
    assert all_released(blocks)


@pytest.fixture(scope="module")
def gpt2():
    folder = checkpoint("openai-community/gpt2")
    return load(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def smollm2():
    folder = checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    return load(folder), load_tokenizer(folder)


@pytest.fixture(scope="module", params=["gpt2", "smollm2"])
def stand_in(request):
    model, tok = request.getfixturevalue(request.param)
    prompts = [tok.encode(SYSTEM + q) for q in QUESTIONS]
    expected = [generate(model, torch.tensor([ids]), max_new_tokens=N_NEW, eos_token_id=None)[0, len(ids):].tolist()
                for ids in prompts]
    return model, tok, prompts, expected


def staggered(engine, prompts, first_steps=3):
    """The first prompt alone for a few steps (its prefill, then decodes), then the others while it decodes."""
    seqs = [engine.add(prompts[0], GREEDY)]
    for _ in range(first_steps):
        engine.step()
    assert seqs[0].finish_reason is None and seqs[0].output_ids, "the first request should still be decoding"
    seqs += [engine.add(ids, GREEDY) for ids in prompts[1:]]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def test_a_request_hits_a_prefix_another_is_still_decoding_after(stand_in):
    model, tok, prompts, expected = stand_in
    plain = Engine(model, tok, n_blocks=64, block_size=4, max_batch=8)
    cached = PrefixCachingEngine(model, tok, n_blocks=64, block_size=4, max_batch=8)
    assert staggered(plain, prompts) == expected
    assert staggered(cached, prompts) == expected
    s = cached.scheduler
    # every later request found at least the system prompt's full blocks; the repeated question all but its last token
    n_system = len(tok.encode(SYSTEM)) // 4 * 4
    assert s.n_shared_tokens >= (len(prompts) - 2) * (n_system - 4) + (len(prompts[2]) - 1) // 4 * 4
    assert plain.scheduler.n_shared_tokens == 0
    assert all_released(cached.blocks)


def test_preempted_while_holding_shared_blocks(stand_in, monkeypatch):
    model, tok, prompts, expected = stand_in
    engine = PrefixCachingEngine(model, tok, n_blocks=14, block_size=4, max_batch=5)  # the five need ~40
    held_shared = []
    preempt = Scheduler.preempt

    def watched(self, seq):
        held_shared.append(any(self.blocks.ref_counts[b] > 1 for b in seq.block_table))
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "preempt", watched)
    assert staggered(engine, prompts) == expected
    assert any(held_shared), f"no sequence was preempted while it held a shared block ({len(held_shared)} preempted)"
    assert all_released(engine.blocks)


def test_eviction_in_a_tiny_pool(stand_in):
    model, tok, prompts, expected = stand_in
    engine = PrefixCachingEngine(model, tok, n_blocks=12, block_size=4, max_batch=2)  # 48 positions
    assert staggered(engine, prompts) == expected
    assert engine.blocks.n_evictions > 0
    assert all_released(engine.blocks)
    again = engine.generate([prompts[3]], GREEDY)[0]  # what is still cached serves it; the answer is the same
    assert again.output_ids == expected[3]
    assert all_released(engine.blocks)


def test_abort_gives_back_only_its_own_references(gpt2):
    model, tok = gpt2
    engine = PrefixCachingEngine(model, tok, n_blocks=32, block_size=4)
    ids = tok.encode(SYSTEM + QUESTIONS[0])
    a = engine.add(ids, GREEDY)
    engine.step()
    engine.step()
    b = engine.add(ids, GREEDY)
    engine.step()  # b admitted, sharing a's full prompt blocks
    shared = [x for x in b.block_table if x in a.block_table]
    assert shared and all(engine.blocks.ref_counts[x] == 2 for x in shared)
    engine.abort(b)
    assert all(engine.blocks.ref_counts[x] == 1 for x in shared) and b.block_table == []
    engine.abort(engine.add(ids, GREEDY))  # aborted while still waiting: it held nothing
    while engine.has_work():
        engine.step()
    assert a.finish_reason == "length" and all_released(engine.blocks)


def test_stats_report_hits_misses_and_the_hit_rate(gpt2):
    model, tok = gpt2
    ids = tok.encode(SYSTEM + QUESTIONS[1])
    engine = PrefixCachingEngine(model, tok, n_blocks=32, block_size=4)
    engine.generate([ids], GREEDY)
    engine.generate([ids], GREEDY)
    stats = EngineThread(engine).stats()
    hits = (len(ids) - 1) // 4 * 4
    assert stats["prefix_cache"] is True
    assert (stats["prefix_cache_hit_tokens"], stats["prefix_cache_miss_tokens"]) == (hits, 2 * len(ids) - hits)
    assert stats["prefix_cache_hit_rate"] == round(hits / (2 * len(ids)), 4)
    plain = EngineThread(Engine(model, tok, n_blocks=32, block_size=4)).stats()
    assert plain["prefix_cache"] is False and plain["prefix_cache_hit_rate"] == 0.0


@pytest.mark.parametrize("flags, caching", [([], True), (["--no-prefix-cache"], False)])
def test_serve_runs_the_prefix_cache_unless_told_not_to(monkeypatch, flags, caching):
    chosen = {}
    monkeypatch.setattr(hardway.server.launch, "serve", lambda *args, **kwargs: chosen.update(kwargs))
    assert cli.main(["serve", "--model", "openai-community/gpt2", "--device", "cpu", *flags]) == 0
    assert chosen["config"].prefix_caching is caching


def test_the_engine_reads_prefix_caching_from_its_config(gpt2):
    """prefix_caching=True: the engine builds its scheduler with the prefix-caching block manager (no swap after);
    PrefixCachingEngine is that engine, whatever its config said."""
    model, tok = gpt2
    assert type(Engine(model, tok, n_blocks=8, prefix_caching=True).blocks) is PrefixCachingBlockManager
    assert type(Engine(model, tok, n_blocks=8).blocks) is not PrefixCachingBlockManager
    assert PrefixCachingEngine(model, tok, EngineConfig(n_blocks=8)).config.prefix_caching
