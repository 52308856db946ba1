"""Lesson 15's sliding layers' pool: a model whose `sliding_windows` names layers that attend to a window gets a
second pool for them, whose blocks go back as the window moves on.

On a tiny random Gemma 3 (lesson 20: five layers of every six attend to a window of 8 positions), the engine's greedy
answers must be token-identical to `hardway.generate` on each prompt alone (lesson 08's cache, every position kept,
the model's own window mask), with several requests at once, chunked prefills beside decodes, preemption and the
compiled decode step; and the sliding pool's blocks in use must stay within the bound the lesson derives, however
long the sequences grow. A model without sliding layers keeps lesson 14's one pool.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from hardway.decode.generate import generate
from hardway.engine.block_manager import FREED, SlidingBlockManager, sliding_block_manager
from hardway.engine.engine import Engine, PrefixCachingEngine
from hardway.engine.sequence import SamplingParams
from hardway.loading import load

WINDOW, BLOCK = 8, 4
PATTERN = tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(6))  # Gemma 3's: 5 sliding, then 1 full
TOKENIZER = SimpleNamespace(decoder={i: bytes([65 + i % 26]) for i in range(120)})


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A seeded random 6-layer Gemma 3 (lesson 20) saved by transformers: layers 0-4 attend to a window of 8
    positions, layer 5 to all."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                              sliding_window=WINDOW, query_pre_attn_scalar=16, bos_token_id=1, eos_token_id=2,
                              layer_types=["full_attention" if w is None else "sliding_attention" for w in PATTERN])
    reference = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # the default init leaves the norms' weights at 0: make every tensor matter
        for name, p in reference.named_parameters():
            p.copy_(0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    reference.save_pretrained(folder)
    model = load(folder)
    assert model.sliding_windows == PATTERN
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A seeded random 6-layer Llama (GQA, tied head): no sliding layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                             tie_word_embeddings=True)).eval()
    folder = tmp_path_factory.mktemp("tiny-llama-6")
    reference.save_pretrained(folder)
    return load(folder)


def prompts_of(lengths):
    return [torch.randint(0, 120, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def alone(model, ids, n):
    return generate(model, torch.tensor([ids]), max_new_tokens=n, eos_token_id=None)[0, len(ids):].tolist()


def run(engine, prompts, lengths, check=None):
    """Every request at once, stepped to the end; check(engine, batch) after each step. -> the sequences."""
    seqs = [engine.add(p, SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[]))
            for p, n in zip(prompts, lengths)]
    while engine.has_work():
        running = list(engine.running) + list(engine.waiting)
        engine.step()
        if check is not None:
            check(engine, running)
    return seqs


def held(table):
    return sum(block != FREED for block in table)


def test_slide_hands_back_only_blocks_before_every_future_window():
    blocks = SlidingBlockManager(n_blocks=6, block_size=4, window=8)
    table = []
    assert blocks.grow(table, 14) and len(table) == 4 and blocks.n_free == 2
    assert blocks.slide(table, 10) == 0  # the query at 10 reads 3..10: block 0 (positions 0-3) is still needed
    assert blocks.slide(table, 12) == 1 and table[0] == FREED and blocks.n_free == 3  # reads 5..12
    assert blocks.slide(table, 12) == 0  # nothing twice
    assert blocks.slide(table, 16) == 1 and table[:2] == [FREED, FREED]  # reads 9..16: block 1 (4-7) goes
    assert blocks.grow(table, 20) and len(table) == 5 and blocks.n_free == 3
    blocks.release(table)
    assert table == [] and sorted(blocks.free_blocks) == list(range(6))  # each block back once
    assert blocks.blocks_per_sequence(1) == 3 and blocks.blocks_per_sequence(12) == math.ceil(19 / 4) + 1


def test_the_sliding_pool_is_sized_for_windows_and_refuses_too_small_a_pool():
    assert sliding_block_manager((None, None), 64, 4, 4, 12) is None  # no sliding layer: no second pool
    blocks = sliding_block_manager((8, None, 16), 256, 4, max_batch=4, max_step_tokens=12)
    assert blocks.window == 16 and blocks.n_blocks == 4 * (math.ceil(15 / 4) + 2) + 3
    assert sliding_block_manager((8,), 10, 4, max_batch=4, max_step_tokens=12).n_blocks == 10  # the full pool's
    with pytest.raises(ValueError, match="cannot hold one sequence's step"):
        sliding_block_manager((8,), 64, 4, 4, 12, n_sliding_blocks=5)


def test_engine_with_sliding_layers_equals_generate_and_its_sliding_blocks_stay_bounded(windowed):
    """Four requests, prompts up to 4 windows long and answers 5 windows long, chunked prefills beside decodes: the
    answers are generate()'s; every step, each sequence holds at most ceil((W - 1 + n) / block_size) + 1 sliding
    blocks, and the sliding pool never more than 4 sequences' windows and one step's tokens (19 blocks), while the
    full pool grows past twice that to hold every position."""
    lengths_in, lengths_out = (5, 31, 17, 26), (40, 36, 44, 30)
    prompts = prompts_of(lengths_in)
    expected = [alone(windowed, p, n) for p, n in zip(prompts, lengths_out)]
    engine = Engine(windowed, TOKENIZER, n_blocks=128, block_size=BLOCK, max_batch=4, max_step_tokens=12)
    sliding = engine.sliding_blocks
    assert sliding.n_blocks == 4 * (math.ceil((WINDOW - 1) / BLOCK) + 2) + math.ceil(12 / BLOCK) == 19
    assert engine.runner.cache.sliding == [w is not None for w in PATTERN]
    peak = {"sliding": 0, "full": 0}

    def check(engine, _):
        for seq in engine.running:  # after postprocess: the step's positions are computed, nothing slid yet
            assert held(seq.sliding_table) <= math.ceil((WINDOW - 1 + 12) / BLOCK) + 1
        peak["sliding"] = max(peak["sliding"], sliding.n_blocks - sliding.n_free)
        peak["full"] = max(peak["full"], engine.blocks.n_blocks - engine.blocks.n_free)

    seqs = run(engine, prompts, lengths_out, check)
    assert [s.output_ids for s in seqs] == expected
    assert peak["sliding"] <= 19 and peak["full"] > 2 * 19  # the full pool held every position of the four
    assert sliding.n_free == sliding.n_blocks and engine.blocks.n_free == engine.blocks.n_blocks


def test_a_short_sliding_pool_preempts_and_the_answers_stay_the_same(windowed):
    """A sliding pool of 8 blocks (one sequence's step needs up to 6) and a large full pool: the sliding pool alone
    forces preemptions; the recomputed sequences still answer as generate()."""
    lengths_in, lengths_out = (9, 22, 14), (30, 20, 26)
    prompts = prompts_of(lengths_in)
    expected = [alone(windowed, p, n) for p, n in zip(prompts, lengths_out)]
    engine = Engine(windowed, TOKENIZER, n_blocks=128, block_size=BLOCK, max_batch=3, max_step_tokens=12,
                    n_sliding_blocks=8)
    seqs = run(engine, prompts, lengths_out)
    assert [s.output_ids for s in seqs] == expected
    assert engine.n_preemptions > 0
    assert engine.sliding_blocks.n_free == 8 and engine.blocks.n_free == 128


def test_without_the_sliding_pool_and_with_prefix_caching_the_answers_are_the_same(windowed):
    """sliding_pool=False keeps every layer in the one pool; PrefixCachingEngine caches no prefix for a model with
    sliding layers (and says so in `caches_prefixes`); both answer as generate()."""
    prompts = prompts_of((20, 20))
    prompts[1][:16] = prompts[0][:16]  # a shared prefix of four blocks, which a prefix cache would reuse
    expected = [alone(windowed, p, 24) for p in prompts]
    one_pool = Engine(windowed, TOKENIZER, n_blocks=64, block_size=BLOCK, sliding_pool=False)
    assert one_pool.sliding_blocks is None and not any(one_pool.runner.cache.sliding)
    assert [s.output_ids for s in run(one_pool, prompts, (24, 24))] == expected
    prefix = PrefixCachingEngine(windowed, TOKENIZER, n_blocks=64, block_size=BLOCK, max_batch=1)
    assert not prefix.blocks.caches_prefixes and prefix.sliding_blocks is not None
    assert [s.output_ids for s in run(prefix, prompts, (24, 24))] == expected
    assert prefix.scheduler.n_shared_tokens == 0


def test_compiled_decode_with_sliding_layers_equals_generate(windowed):
    """Decode steps through CompiledDecode (traced by dynamo, run eagerly: the eager backend keeps it fast), a
    batch of 2 padded to 4: the padding rows use each pool's own scratch slot; answers as generate()."""
    prompts = prompts_of((6, 13))
    expected = [alone(windowed, p, 30) for p in prompts]
    engine = Engine(windowed, TOKENIZER, n_blocks=64, block_size=BLOCK, compile_sizes=(4,), backend="eager")
    cache = engine.runner.cache
    assert cache.sliding_scratch_slot == engine.sliding_blocks.n_blocks * BLOCK
    assert [s.output_ids for s in run(engine, prompts, (30, 30))] == expected
    assert cache.sliding_write_slots.tolist()[-2:] == [cache.sliding_scratch_slot] * 2  # the last step's padding


def test_a_model_without_sliding_layers_keeps_one_pool(llama):
    model = llama
    engine = Engine(model, TOKENIZER, n_blocks=16, block_size=BLOCK)
    cache = engine.runner.cache
    assert engine.sliding_blocks is None and not engine.runner.has_sliding
    assert [tuple(k.shape) for k in cache.k] == [(16 * BLOCK + 1, 2, 16)] * 6
    assert cache.bytes_per_block() == 2 * 6 * BLOCK * 2 * 16 * 4 and cache.bytes_per_block(sliding=True) == 0
    seq = run(engine, prompts_of((7,)), (5,))[0]
    assert seq.sliding_table == [] and seq.sliding_mapping is None
