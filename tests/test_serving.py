"""Lesson 14's engine without HTTP: the block manager, the paged KV cache, and continuous batching with preemption.

The engine's greedy output must be token-identical to `hardway.generate` on each prompt alone (fp32 stand-ins),
whatever else is in the batch, and also for sequences that were preempted and recomputed.
"""

from types import SimpleNamespace

import pytest
import torch

from hardway.generation import generate
from hardway.hub import checkpoint
from hardway.kv_cache import KVCache
from hardway.loading import load
from hardway.serving import (BlockManager, Engine, ModelRunner, OutputProcessor, PagedKVCache, PoolTooSmallError,
                             SamplingParams, Sequence, apply_stop, slot_of)
from hardway.tokenizer import load_tokenizer

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a", "def fib(n):",
           "1, 2, 3, 4,"]


def test_block_manager_grows_refuses_and_releases():
    blocks = BlockManager(n_blocks=5, block_size=4)
    a, b = [], []
    assert blocks.grow(a, 9) and len(a) == 3 and blocks.n_free == 2  # 9 positions: 3 blocks of 4
    assert blocks.grow(a, 12) and len(a) == 3  # still fits in its 3 blocks
    assert not blocks.grow(b, 12) and b == [] and blocks.n_free == 2  # 3 needed, 2 free: nothing taken
    assert blocks.grow(b, 8) and blocks.n_free == 0
    assert set(a).isdisjoint(b)
    blocks.release(a)
    assert a == [] and blocks.n_free == 3


def test_slot_of():
    assert [slot_of([7, 2], p, 4) for p in range(8)] == [28, 29, 30, 31, 8, 9, 10, 11]


def test_paged_cache_returns_what_a_contiguous_cache_holds():
    """Two sequences of different lengths in scattered blocks: every real position reads back what KVCache holds,
    left-padded, and the mask marks exactly the real positions."""
    torch.manual_seed(0)
    H, d, bs = 2, 8, 4
    pool = PagedKVCache(n_layers=1, n_blocks=8, block_size=bs, n_kv_heads=H, head_dim=d)
    tables = [[5, 1, 6], [3, 0]]
    lengths = [9, 5]  # positions already written
    full = [torch.randn(1, H, n + 1, d) for n in lengths]  # each sequence's keys for positions 0..n
    refs = []
    slots = [torch.tensor([slot_of(table, p, bs) for p in range(n + 1)]) for table, n in zip(tables, lengths)]
    for row, n, k in zip(slots, lengths, full):  # write the history of each sequence alone
        pool.bind([row[:n]], [n])
        pool.update(0, 0, k[:, :, :n], k[:, :, :n])
        ref = KVCache(1, 1, n + 1, H, d)
        refs.append(ref.update(0, 0, k, k)[0])  # (1, H, n + 1, d)
    mask = pool.bind(slots, [1, 1])  # (2, 10): one new position each
    new = torch.cat([k[:, :, -1:] for k in full])  # (2, H, 1, d)
    keys, values = pool.update(0, max(lengths), new, new)  # (2, H, 10, d)
    assert keys.shape == (2, H, 10, d)
    assert mask.tolist() == [[1] * 10, [0] * 4 + [1] * 6]
    assert torch.equal(keys[0], refs[0][0]) and torch.equal(keys[1, :, 4:], refs[1][0])
    assert torch.equal(values[1, :, 4:], refs[1][0])


@pytest.fixture(scope="module")
def gpt2():
    folder = checkpoint("openai-community/gpt2")
    return load(folder), load_tokenizer(folder)


def alone(model, ids, n, eos=None):
    """hardway.generate on one prompt by itself, cut at the first end-of-sequence token."""
    out = generate(model, torch.tensor([ids]), max_new_tokens=n, eos_token_id=eos if eos is not None
                   else model.eos_token_ids)[0, len(ids):].tolist()
    stops = model.eos_token_ids if eos is None else eos
    return out[:next((i for i, t in enumerate(out) if t in stops), len(out))]


def test_engine_equals_generate_alone_with_preemption(gpt2):
    """Four prompts decoded together in a pool too small for all of them: some are preempted and recomputed, and
    every output is still token-identical to generate() on that prompt alone."""
    model, tok = gpt2
    prompts = [tok.encode(p) for p in PROMPTS]
    n = 8
    expected = [alone(model, ids, n) for ids in prompts]
    engine = Engine(model, tok, n_blocks=12, block_size=4, max_batch=4)  # 48 positions; the four need ~70
    seqs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0))
    assert engine.n_preemptions > 0, "the pool was meant to run out: nothing was preempted"
    assert [s.output_ids for s in seqs] == expected
    assert [s.text for s in seqs] == [tok.decode(e) for e in expected]
    assert all(s.finish_reason == "length" for s in seqs)
    assert engine.blocks.n_free == engine.blocks.n_blocks  # every block back in the pool


def test_engine_seeded_sampling_equals_generate(gpt2):
    """A seeded sampled request draws the same tokens as generate() with a generator seeded the same way."""
    model, tok = gpt2
    ids = tok.encode(PROMPTS[0])
    g = torch.Generator().manual_seed(7)
    out = generate(model, torch.tensor([ids]), max_new_tokens=5, do_sample=True, temperature=0.8, top_p=0.9,
                   generator=g)[0, len(ids):].tolist()
    engine = Engine(model, tok, n_blocks=16, block_size=4)
    [seq] = engine.generate([ids], SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=7))
    assert seq.output_ids == out[:len(seq.output_ids)] and len(seq.output_ids) >= 1


def test_engine_refuses_what_the_pool_cannot_hold_and_abort_frees(gpt2):
    model, tok = gpt2
    engine = Engine(model, tok, n_blocks=4, block_size=4)
    with pytest.raises(PoolTooSmallError, match="more than this engine can hold"):
        engine.add(list(range(10)), SamplingParams(max_tokens=7))  # 17 positions > 16
    seq = engine.add(tok.encode(PROMPTS[0]), SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    assert engine.blocks.n_free < 4 and seq in engine.running
    engine.abort(seq)
    assert engine.blocks.n_free == 4 and not engine.has_work() and seq.finish_reason == "abort"


def test_stop_strings_cut_the_text_and_streaming_holds_back_a_possible_stop():
    assert apply_stop("Hello world. Bye", [".", "Bye"]) == ("Hello world", True)
    assert apply_stop("Hello", ["xyz"]) == ("Hello", False)
    new_text = OutputProcessor.new_text  # needs no model
    seq = Sequence([1], SamplingParams(stop=["END"]))
    seq.text = "abcEN"
    assert new_text(seq, finished=False) == "abc"  # "EN" may become "END": held back
    seq.text = "abcENxy"
    assert new_text(seq, finished=False) == "EN"  # only the last len("END") - 1 characters wait
    assert new_text(seq, finished=True) == "xy"  # finished: everything


def test_engine_stops_at_a_stop_string(gpt2):
    model, tok = gpt2
    ids = tok.encode(PROMPTS[3])
    out = alone(model, ids, 8)
    full, stop = tok.decode(out), tok.decode(out[2:3])  # stop at the third token's text, wherever it first occurs
    engine = Engine(model, tok, n_blocks=16, block_size=4)
    [seq] = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, stop=[stop]))
    assert seq.text == full[:full.index(stop)] and seq.finish_reason == "stop"
    assert engine.blocks.n_free == 16


# --- a request the engine cannot compute fails alone -------------------------------------------------------------

POISON = " Poison pill"  # a prompt whose forward passes are made to raise


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_sequence_whose_forward_raises_fails_alone(gpt2, monkeypatch, phase):
    """The poisoned sequence's forward pass raises, at its prefill or in the batched decode it shares with three
    others: it alone finishes with "error", the others' tokens equal generate() alone, and every block is back."""
    model, tok = gpt2
    prompts, poison = [tok.encode(p) for p in PROMPTS[:3]], tok.encode(POISON)
    expected = [alone(model, ids, 6) for ids in prompts]
    forward = ModelRunner.forward

    def raising_forward(self, seqs, n_new):
        poisoned = [s for s in seqs if s.prompt_ids == poison]
        if poisoned and (phase == "decode") == bool(poisoned[0].output_ids):
            raise RuntimeError("injected failure")
        return forward(self, seqs, n_new)

    monkeypatch.setattr(ModelRunner, "forward", raising_forward)
    engine = Engine(model, tok, n_blocks=64, block_size=4, max_batch=8)
    params = SamplingParams(max_tokens=6, temperature=0)
    good = [engine.add(ids, params) for ids in prompts[:2]]
    bad = engine.add(poison, params)
    good.append(engine.add(prompts[2], params))
    events = []
    while engine.has_work():
        events += engine.step()
    assert bad.finish_reason == "error" and "RuntimeError: injected failure" in bad.error
    assert [e.finished for e in events if e.seq is bad][-1] and sum(e.seq is bad for e in events) <= 2
    assert [s.output_ids for s in good] == expected and all(s.finish_reason == "length" for s in good)
    assert engine.blocks.n_free == 64 and not engine.running


def test_engine_refuses_token_ids_outside_the_vocabulary(gpt2):
    model, tok = gpt2
    engine = Engine(model, tok, n_blocks=16, block_size=4)
    for bad in (50257, -1, True, 3.0):
        with pytest.raises(ValueError, match=rf"token id {bad!r} is not in this model's vocabulary: ids run from 0 "
                                             rf"to 50256"):
            engine.add([464, bad], SamplingParams(max_tokens=2))
    assert not engine.has_work()


def test_engine_refuses_a_tokenizer_with_ids_the_model_lacks(gpt2):
    model, _ = gpt2
    tokenizer = SimpleNamespace(decoder={0: b"a", 50257: b"<|extra|>"})  # one id past GPT-2's 50257 rows
    with pytest.raises(ValueError, match=r"the tokenizer has token ids up to 50257, but the model's vocabulary has "
                                         r"only 50257 \(ids 0 to 50256\)"):
        Engine(model, tokenizer, n_blocks=4, block_size=4)


def test_a_tiny_temperature_decodes_as_greedy(gpt2):
    """temperature 1e-40 (allowed: OpenAI's range is [0, 2]) used to make NaN probabilities and kill the step."""
    model, tok = gpt2
    ids = tok.encode(PROMPTS[1])
    engine = Engine(model, tok, n_blocks=16, block_size=4)
    [seq] = engine.generate([ids], SamplingParams(max_tokens=6, temperature=1e-40, seed=3))
    assert seq.output_ids == alone(model, ids, 6)
