"""Lesson 14's engine without HTTP: the block manager, the paged KV cache, and continuous batching with preemption.

The engine's greedy output must be token-identical to `hardway.generate` on each prompt alone (fp32 stand-ins),
whatever else is in the batch, and also for sequences that were preempted and recomputed.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hardway.decode.generate import generate
from hardway.formats.hub import checkpoint
from hardway.models.kv_cache import KVCache
from hardway.loading import load
from hardway.decode.sampling import SamplingConfig
from hardway.engine.block_manager import BlockManager, PoolTooSmallError, slot_of
from hardway.engine.config import EngineConfig
from hardway.engine.engine import Engine
from hardway.kernels.onednn import MergedAttention, MergedMLP, OneDNNLinear
from hardway.engine.model_runner import CompileState, ModelRunner
from hardway.engine.output import OutputProcessor, apply_stop
from hardway.engine.paged_cache import PagedKVCache
from hardway.engine.sequence import SamplingParams, SamplingParamsError, Sequence, StepStats
from hardway.engine.scheduler import Scheduler
from hardway.server.worker import EngineThread
from hardway.text.detokenizer import Detokenizer
from hardway.text.tokenizer import load_tokenizer

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
    params = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=7)
    assert params.sampling == SamplingConfig(do_sample=True, temperature=0.8, top_p=0.9)  # lesson 07's settings
    g = torch.Generator().manual_seed(7)
    out = generate(model, torch.tensor([ids]), max_new_tokens=5, sampling=params.sampling, generator=g)
    out = out[0, len(ids):].tolist()
    engine = Engine(model, tok, n_blocks=16, block_size=4)
    [seq] = engine.generate([ids], params)
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
    words = {0: b"ab", 1: b"c", 2: b"E", 3: b"N", 4: b"xy", 5: b"\xc3", 6: b"\xa9", 7: b"D"}  # 5 then 6: "é"
    output = OutputProcessor(SimpleNamespace(decoder=words), eos_token_ids=[99])  # needs no model

    def outputs(params, tokens):
        seq = Sequence([1], params)
        outs = [output.accept(seq, t) for t in tokens]
        return [None if o is None else (o.token_ids, o.text, o.finish_reason) for o in outs]

    # "EN" may become "END": held back, from the start of the token it begins in, with its tokens
    assert outputs(SamplingParams(max_tokens=6, stop=["END"]), [0, 1, 2, 3, 4]) == [
        None, None, ((0,), "ab", None), ((1,), "c", None), ((2, 3), "EN", None)]
    assert outputs(SamplingParams(max_tokens=5, stop=["END"]), [0, 1, 2, 3, 4])[-1] == ((2, 3, 4), "ENxy", "length")
    assert outputs(SamplingParams(max_tokens=5, stop=["END"]), [0, 2, 3, 7]) == [
        None, None, ((0,), "ab", None), ((2, 3, 7), "", "stop")]  # the last: its text stops before "END"
    # half a character waits, with its token, for the rest of its bytes
    assert outputs(SamplingParams(max_tokens=5), [0, 5, 6, 99]) == [
        ((0,), "ab", None), None, ((5, 6), "é", None), ((), "", "stop")]


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
        events += engine.step()[0]  # (outputs, stats)
    assert bad.finish_reason == "error" and "RuntimeError: injected failure" in bad.error
    assert [e.finished for e in events if e.request_id == bad.id][-1]
    assert sum(e.request_id == bad.id for e in events) <= 2
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


# --- the split: scheduler alone, runner's rows, output processor ----------------------------------------------------

def _scheduler_with(n_blocks, budget, running, waiting, max_batch=4):
    """A Scheduler in a given state, no model: running (prompt length, tokens generated), waiting prompt lengths."""
    scheduler = Scheduler(n_blocks, 4, max_batch=max_batch, max_step_tokens=budget)
    for n_prompt, n_out in running:
        seq = Sequence(list(range(n_prompt)), SamplingParams(max_tokens=16), output_ids=[0] * n_out)
        seq.n_cached = len(seq.tokens) - 1
        assert scheduler.blocks.grow(seq.block_table, seq.n_cached)
        scheduler.running.append(seq)
    for n_prompt in waiting:
        scheduler.add(Sequence(list(range(n_prompt)), SamplingParams(max_tokens=16)))
    return scheduler


def test_scheduler_runs_the_running_first_and_admits_only_without_preemption():
    s = _scheduler_with(4, 64, [(8, 1)], [8])  # the running one needs a 3rd block; the prompt would take the last 2
    old, new = s.running[0], s.waiting[0]
    batch = s.schedule()
    assert batch.seqs == [old] and batch.n_new == [1] and not batch.admitted and list(s.waiting) == [new]
    s = _scheduler_with(5, 6, [(8, 1), (12, 1)], [])  # the older needs a block: the latest arrival goes
    a, c = s.running
    batch = s.schedule()
    assert batch.preempted == [c] and batch.seqs == [a] and not batch.admitted  # c could come back in a chunk: not now
    assert c.n_cached == 0 and c.block_table == [] and list(s.waiting) == [c] and c.n_preemptions == 1
    batch = s.schedule()  # next step: the pool is not short any more, c comes back, chunked under the budget
    assert batch.admitted == [c] and batch.n_new == [1, 5] and not batch.preempted


def test_scheduler_batches_prefills_and_chunks_under_the_budget():
    s = _scheduler_with(64, 16, [(4, 1), (4, 2)], [5, 7, 30], max_batch=8)
    batch = s.schedule()
    assert batch.n_new == [1, 1, 5, 7, 2]  # two decodes, two whole prompts, and the first 2 tokens of the third
    assert len(batch.admitted) == 3 and sum(batch.n_new) == 16
    long = batch.admitted[-1]
    long.n_cached += 2
    for seq, n in zip(batch.seqs[:4], batch.n_new[:4]):  # the others computed theirs and picked a token
        seq.n_cached += n
        seq.output_ids.append(0)
    batch = s.schedule()
    assert batch.seqs[-1] is long and batch.n_new == [1, 1, 1, 1, 12]  # its next chunk: the rest of the budget


def test_preempted_sequences_come_back_in_order_of_arrival():
    s = _scheduler_with(6, 64, [(4, 1), (4, 1), (4, 1)], [])  # each holds 1 block and needs a 2nd: 3 free
    for seq in s.running:  # make them need 2 more blocks each
        seq.output_ids += [0] * 4
        seq.n_cached += 4
    a, b, c = s.running
    s.schedule()
    assert [x.id for x in s.running] == sorted(x.id for x in s.running)
    assert all(v.id > r.id for v in s.waiting for r in s.running)  # only later arrivals were preempted


def test_row_width_keeps_decodes_at_one_and_splits_long_prefills():
    assert ModelRunner.row_width([1, 1, 1], 100) == 1
    assert ModelRunner.row_width([5, 7], 20) == 7  # two short prompts: one row each
    width = ModelRunner.row_width([1] * 15 + [256], 300)  # decodes beside a long chunk: rows of less than 256
    assert 1 < width < 256
    prompts = [25, 26, 27, 27, 28, 28, 28, 28]
    assert ModelRunner.row_width(prompts, 28) == 28  # prompts of similar lengths alone: one row each
    # 8 decodes beside 8 prompts of ~28 tokens: timed on one CPU thread, rows of 4 (480 ms) beat 8 (527 ms), 16 (575 ms)
    # and one row per prompt (640 ms), which would pad every decode to 28 tokens
    assert ModelRunner.row_width([1] * 8 + prompts, 60) == 4


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_onednn_linear_computes_batches_with_onednn_and_leaves_one_row_to_torch(gpt2):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96)
    x = torch.randn(5, 3, 64)  # (B, T, in)
    with torch.inference_mode():
        ref, ref_one = layer(x), layer(x[:1, -1:])
        got, one = OneDNNLinear(layer)(x), OneDNNLinear(layer)(x[:1, -1:])
        onednn = torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
    assert torch.equal(got, onednn), "a batch is not computed by oneDNN"
    assert torch.equal(one, ref_one), "one row is not torch's own linear, bit for bit"
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), "oneDNN's batch differs by more than fp32 rounding"
    model = gpt2[0]
    runner = ModelRunner(model, EngineConfig(n_blocks=8, block_size=8))  # fp32 on the CPU: the twin with oneDNN linears
    assert runner.model is not model and not any(isinstance(m, OneDNNLinear) for m in model.modules())
    assert all(type(m) is not torch.nn.Linear for m in runner.model.modules())
    twin = dict(runner.model.named_parameters())
    assert all(twin[name] is p for name, p in model.named_parameters()), "the twin copied a parameter"


@pytest.fixture(scope="module")
def smollm2():
    folder = checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    return load(folder), load_tokenizer(folder)


@pytest.mark.parametrize("stand_in", ["gpt2", "smollm2"])
def test_batched_and_chunked_prefill_with_preemption_equal_generate(stand_in, request):
    """Five prompts, one of ~70 tokens, under a budget of 24 tokens per step in a pool too small for all: several
    prompts prefilled in one pass, the long one in chunks of several rows beside running decodes, preemptions; every
    answer token-identical to generate() alone, every block back."""
    model, tok = request.getfixturevalue(stand_in)
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 7)
    prompts = [tok.encode(p) for p in PROMPTS + [long]]
    n = 8
    expected = [alone(model, ids, n) for ids in prompts]
    engine = Engine(model, tok, n_blocks=14, block_size=8, max_batch=5, max_step_tokens=24)
    widths = []
    row_width = engine.runner.row_width
    engine.runner.row_width = lambda n_new, s: widths.append((list(n_new), row_width(n_new, s))) or widths[-1][1]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0))
    assert [s.output_ids for s in seqs] == expected
    assert engine.n_preemptions > 0, "the pool was meant to run out"
    assert any(sum(k > 1 for k in n_new) >= 2 for n_new, _ in widths), "no step prefilled two prompts at once"
    assert any(max(n_new) > w for n_new, w in widths), "no prefill chunk was split over several rows"
    assert any(1 in n_new and max(n_new) > 1 for n_new, _ in widths), "no step mixed decodes and a prefill"
    assert sorted(engine.blocks.free_blocks) == list(range(14))


def test_detokenizer_equals_the_tokenizers_streaming_decoder(smollm2):
    """Token by token, our incremental detokenizer hands out what tokenizers' DecodeStream hands out, half
    characters held back, and the whole equals decode()."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    _, tok = smollm2
    reference = Tokenizer.from_file(str(checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct") / "tokenizer.json"))
    text = "Crème brûlée, 日本語, 🐉🍳 and ∑ x² — done."
    ids = tok.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    ours, theirs = Detokenizer(tok.decoder), DecodeStream(skip_special_tokens=False)
    ours_so_far = theirs_so_far = ""
    for i in ids:
        piece = ours.push(i)
        assert "\ufffd" not in piece  # half a character is held back, never sent
        ours_so_far += piece
        theirs_so_far += theirs.step(reference, i) or ""
        assert ours_so_far.startswith(theirs_so_far) or theirs_so_far.startswith(ours_so_far)  # never different text
    assert ours_so_far + ours.flush() == theirs_so_far == tok.decode(ids) == text


def test_streamed_text_equals_the_finished_text_with_a_multibyte_stop(gpt2):
    model, tok = gpt2
    ids = tok.encode(PROMPTS[1])
    out = alone(model, ids, 10)
    stop = tok.decode(out[4:6])
    engine = Engine(model, tok, n_blocks=16, block_size=4)
    seq = engine.add(ids, SamplingParams(max_tokens=10, temperature=0, stop=[stop]))
    pieces = []
    while engine.has_work():
        pieces += [e.text for e in engine.step()[0] if e.request_id == seq.id]
    assert "".join(pieces) == seq.text == tok.decode(out)[:tok.decode(out).index(stop)]


def watched_graphs(engine, calls=None):
    """Wrap each compiled graph of engine's CompiledDecode (made by its compile): record every call's (batch size,
    real rows) in `calls`, and check that the call changed the pool only in the real rows' slots and the scratch
    slot. -> the list of records."""
    cache, calls = engine.runner.cache, [] if calls is None else calls
    for size, graph in list(engine.runner.decode.graphs.items()):
        def watched(model, input_ids, mask, pool, graph=graph, size=size):
            writes = pool.write_slots.tolist()  # (size,): the real rows' slots, then the padding rows'
            real = [s for s in writes if s != pool.scratch_slot]
            before = [t.clone() for t in pool.k + pool.v]
            out = graph(model, input_ids, mask, pool)
            changed = set()
            for old, new in zip(before, pool.k + pool.v):  # compared bit for bit: a twin's garbage may hold NaNs
                differs = old.view(torch.uint8) != new.view(torch.uint8)
                changed |= set(differs.flatten(1).any(1).nonzero().flatten().tolist())
            assert changed <= set(real) | {pool.scratch_slot}, "a padding row wrote into a real slot"
            calls.append((size, len(real)))
            return out
        engine.runner.decode.graphs[size] = watched
    return calls


def test_compiled_decode_steps_equal_generate_and_padding_writes_only_the_scratch_slot(gpt2):
    """Decode steps compiled for batch sizes 1 and 4 (the graph captured whole, run by torch.compile's "aot_eager"
    backend: compiling GPT-2 with inductor takes a minute per size): three requests that finish at different steps
    run as 3, 2 and 1 rows (padded to 4, 4, 1), each step's S a symbolic size of one graph per batch size; every
    answer token-identical to generate() alone, every block back."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, tok = gpt2
    counter = CompileCounterWithBackend("aot_eager")
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    lengths = [4, 7, 10]
    expected = [alone(model, ids, n) for ids, n in zip(prompts, lengths)]
    engine = Engine(model, tok, n_blocks=24, block_size=4, max_batch=4, compile_sizes=(1, 4), backend=counter)
    assert counter.frame_count == 2, "compile_now compiles one graph per batch size"
    calls = watched_graphs(engine)
    seqs = [engine.add(ids, SamplingParams(max_tokens=n, temperature=0)) for ids, n in zip(prompts, lengths)]
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == expected
    assert {(4, 3), (4, 2), (1, 1)} <= set(calls), f"batches run: {sorted(set(calls))}"
    assert counter.frame_count == 2, "a new S or a smaller batch recompiled"
    assert sorted(engine.blocks.free_blocks) == list(range(24))


def test_compiled_decode_falls_back_to_eager_for_other_shapes(gpt2):
    """Compiled for batch size 1 only: a step of two decodes, and a step with a prefill in it, run eagerly."""
    model, tok = gpt2
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    expected = [alone(model, ids, 5) for ids in prompts]
    engine = Engine(model, tok, n_blocks=16, block_size=4, compile_sizes=(1,), backend="aot_eager")
    calls = watched_graphs(engine)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    assert [s.output_ids for s in seqs] == expected
    assert calls == [], "two rows were decoded by the graph compiled for one"


def test_a_compile_in_the_background_leaves_the_pool_alone_and_its_graphs_serve_the_engine(gpt2):
    """background_compile=True (what `hardway serve` does): the engine answers before anything is compiled, with
    eager steps; the compile, in a thread of its own, runs on a twin of the pool and leaves the engine's pool as it
    was, with requests half done in it; the graphs it compiled on the twin then serve the engine's own pool without
    a new graph (their guards check shapes, not which pool); every answer equals generate()'s, before and after."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, tok = gpt2
    counter = CompileCounterWithBackend("aot_eager")
    engine = Engine(model, tok, n_blocks=24, block_size=4, max_batch=4, compile_sizes=(1, 4), backend=counter,
                    background_compile=True)
    decode = engine.runner.decode
    assert counter.frame_count == 0 and decode.ready == set(), "background_compile=True compiled in __init__"
    try:
        check_answers_across_the_switch(engine, decode, counter, model, tok)
    finally:
        torch._dynamo.reset()  # its two graphs would count against the next tests' recompile limit (8 per function)


def check_answers_across_the_switch(engine, decode, counter, model, tok):
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    lengths = [6, 9, 12]
    expected = [alone(model, ids, n) for ids, n in zip(prompts, lengths)]
    calls = []  # the graphs' calls, once the compile has made them
    assert decode.graphs == {}, "a compiled step was made before its compile"
    def stats():  # what the server's /stats adds
        return EngineThread.compile_stats(SimpleNamespace(engine=engine))
    assert stats() == {"compiled_batch_sizes": [], "compiling_batch_sizes": [1, 4], "compile_error": None}
    seqs = [engine.add(ids, SamplingParams(max_tokens=n, temperature=0)) for ids, n in zip(prompts, lengths)]
    for _ in range(3):  # the prompts and two decode steps, eager: nothing is ready
        engine.step()
    assert calls == [] and all(s.n_cached > len(s.prompt_ids) for s in seqs)
    pool = engine.runner.cache
    before = [t.clone() for t in pool.k + pool.v]
    decode.compile_in_background().join()
    watched_graphs(engine, calls)
    assert decode.error is None and decode.ready == {1, 4} and counter.frame_count == 2
    assert stats() == {"compiled_batch_sizes": [1, 4], "compiling_batch_sizes": [], "compile_error": None}
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k + pool.v)), "the compile wrote into the engine's pool"
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == expected
    assert {(4, 3), (4, 2), (1, 1)} <= set(calls), f"batches run: {sorted(set(calls))}"
    assert counter.frame_count == 2, "the engine's own pool needed graphs of its own"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A seeded random 2-layer Llama (GQA, tied head) saved by transformers, and a tokenizer of one byte per id."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             tie_word_embeddings=True)).eval()
    with torch.no_grad():  # larger than the default init, so that the logits are far from uniform
        for p in reference.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("tiny-llama")
    reference.save_pretrained(folder)
    return load(folder), SimpleNamespace(decoder={i: bytes([65 + i % 26]) for i in range(120)})


def test_compiled_decode_with_the_cpu_backend_equals_generate(tiny_llama):
    """The default backend on a CPU, compiled for real (lesson 12's for one row, weights laid out in rows on a copy;
    inductor's for the padded batch of 4): three requests of different lengths decode as 3, 2 and 1 rows,
    token-identical to generate() alone; the model that the engine and generate() share keeps its layout."""
    model, tokenizer = tiny_llama
    strides = [p.stride() for p in model.parameters()]
    prompts = [torch.randint(0, 120, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 5)]
    lengths = [6, 12, 18]
    expected = [alone(model, ids, n, eos=[]) for ids, n in zip(prompts, lengths)]
    engine = Engine(model, tokenizer, n_blocks=16, block_size=4, compile_sizes=(1, 4))
    calls = watched_graphs(engine)
    seqs = [engine.add(ids, SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[]))
            for ids, n in zip(prompts, lengths)]
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == expected
    assert {(4, 3), (4, 2), (1, 1)} <= set(calls), f"batches run: {sorted(set(calls))}"
    assert [p.stride() for p in model.parameters()] == strides, "the compiled copy's layout leaked into the model"
    assert sorted(engine.blocks.free_blocks) == list(range(16))


def test_compiled_decode_of_several_rows_keeps_onednn(tiny_llama):
    """The graph of several rows is traced from the oneDNN twin: every matrix product in it (4 per block: q, k and v
    merged, o, gate and up merged, down; and the head) is the opaque custom op hardway::onednn_linear, none a matrix
    product the compiler would lower itself; the graph of one row keeps torch's 7 linear layers per block (lesson
    12's matrix-vector products lower those)."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    model, tokenizer = tiny_llama
    recorder = EagerAndRecordGraphs()
    Engine(model, tokenizer, n_blocks=16, block_size=4, compile_sizes=(1, 4), backend=recorder)
    one_row, four_rows = recorder.graphs  # compiled in order of size
    def calls(graph, name):
        return sum(name in str(node.target) for node in graph.graph.nodes if node.op == "call_function")
    n_layers = model.config.num_hidden_layers
    n_products, n_linears = 4 * n_layers + 1, 7 * n_layers + 1
    assert calls(four_rows, "onednn_linear") == n_products and calls(four_rows, "linear") == n_products
    assert calls(one_row, "onednn_linear") == 0 and calls(one_row, "linear") == n_linears


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_merged_projections_equal_the_separate_ones(tiny_llama):
    """The twin's MergedAttention and MergedMLP: several rows through one stacked oneDNN matrix each, equal to lesson
    09's separate projections within fp32 rounding; one row bit for bit torch's own (generate()'s arithmetic); every
    parameter shared with the model, none copied."""
    model = tiny_llama[0]
    twin = ModelRunner(model, EngineConfig(n_blocks=8, block_size=4)).model
    block, twin_block = model.blocks[0], twin.blocks[0]
    assert isinstance(twin_block.attn, MergedAttention) and isinstance(twin_block.mlp, MergedMLP)
    assert twin_block.attn.qkv_proj.sizes == [64, 32, 32] and twin_block.mlp.gate_up_proj.sizes == [96, 96]
    cos, sin = model.rope(torch.arange(3), torch.float32)  # (T, d) each
    torch.manual_seed(1)
    with torch.inference_mode():
        for rows in (5, 1):
            x = torch.randn(rows, 3 if rows > 1 else 1, 64)  # (B, T, C)
            c, s = cos[:x.shape[1]], sin[:x.shape[1]]
            for ref, got in zip(block.attn.qkv(x, c, s), twin_block.attn.qkv(x, c, s)):
                assert ref.shape == got.shape
                if rows == 1:
                    assert torch.equal(ref, got), "one row's q, k, v are not torch's own"
                else:
                    assert (ref - got).abs().max() <= 1e-5 * ref.abs().max(), "merged q, k, v differ beyond rounding"
            ref, got = block.mlp(x), twin_block.mlp(x)
            assert torch.equal(ref, got) if rows == 1 else (ref - got).abs().max() <= 1e-5 * ref.abs().max()
    twin_params = dict(twin.named_parameters())
    assert all(any(t is p for t in twin_params.values()) for p in model.parameters()), "the twin copied a parameter"


BAD_PARAMS = [  # (field, a value its rule refuses)
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True), ("temperature", -0.1),
    ("temperature", float("nan")), ("temperature", "1"), ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("seed", 2**64), ("seed", -2**63 - 1), ("seed", 1.5), ("seed", True), ("stop", [""]), ("stop", [3]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", "2"), ("logprobs", -1),
    ("logprobs", True), ("prompt_logprobs", -1), ("prompt_logprobs", 1.5), ("min_p", -0.1), ("min_p", 1.1),
    ("min_p", float("nan")), ("presence_penalty", float("inf")), ("presence_penalty", "x"),
    ("frequency_penalty", float("nan")), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: 101}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {5: "x"}), ("logit_bias", {True: 1.0}), ("logit_bias", "no"),
    ("logit_bias", [(5,)]), ("constraints", [3]),
]


@pytest.mark.parametrize("field, value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_sampling_params_refuse_each_bad_field_naming_it(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert isinstance(e.value, ValueError) and e.value.field == field and field in str(e.value), str(e.value)


def test_logit_bias_is_frozen_and_checked_against_the_vocabulary(gpt2):
    bias = {7: 2, 3: -1.5}
    params = SamplingParams(logit_bias=bias, temperature=0)
    bias[9] = 5.0  # the caller's dict changes; the request's pairs do not
    assert params.logit_bias == ((3, -1.5), (7, 2.0)) and hash(params.logit_bias)
    assert SamplingParams(logit_bias=[(7, 2), (3, -1.5)]).logit_bias == params.logit_bias  # pairs, as given
    assert SamplingParams(logit_bias={}).logit_bias is None
    params.check_vocabulary(8)  # ids 3 and 7 exist in a vocabulary of 8
    for name, bad in (("logit_bias", SamplingParams(logit_bias={50257: 1.0})),
                      ("stop_token_ids", SamplingParams(stop_token_ids=[50256, 50257]))):
        with pytest.raises(SamplingParamsError, match="50257, outside this model's vocabulary") as e:
            bad.check_vocabulary(50257)
        assert e.value.field == name
        model, tok = gpt2
        engine = Engine(model, tok, n_blocks=16, block_size=4)
        with pytest.raises(SamplingParamsError) as e:  # add checks it, for every request
            engine.add([464], bad)
        assert e.value.field == name and not engine.has_work()


def test_step_returns_its_outputs_and_its_stats_and_abort_its_stats(gpt2):
    model, tok = gpt2
    engine = Engine(model, tok, n_blocks=32, block_size=4)
    assert not hasattr(engine, "on_stats")  # no hook: the records come back from the calls
    ids = tok.encode(PROMPTS[0])
    seq = engine.add(ids, SamplingParams(max_tokens=3, temperature=0, stop_token_ids=[]))
    outputs, stats = engine.step()
    assert [o.request_id for o in outputs] == [seq.id] and len(outputs[0].token_ids) == 1
    assert isinstance(stats, StepStats) and stats.n_tokens == len(ids) and stats.n_running == 1
    assert stats.finished == () and stats.free_blocks == engine.blocks.n_free
    while engine.has_work():
        outputs, stats = engine.step()
    assert outputs[-1].finished and stats.n_tokens == 1 and stats.n_running == 0
    assert [(r.request_id, r.finish_reason, r.n_generated_tokens) for r in stats.finished] == [(seq.id, "length", 3)]
    outputs, stats = engine.step()  # nothing to do
    assert outputs == [] and stats.n_tokens == 0 and stats.finished == ()
    other = engine.add(ids, SamplingParams(max_tokens=3))
    stats = engine.abort(other)
    assert [(r.request_id, r.finish_reason) for r in stats.finished] == [(other.id, "abort")]
    assert stats.total_aborted == 1 and stats.free_blocks == 32 and engine.abort(other) is None  # gone already
    a, b = (engine.add(ids, SamplingParams(max_tokens=3)) for _ in range(2))
    engine.step()
    stats = engine.abort_all()
    assert sorted(r.request_id for r in stats.finished) == [a.id, b.id] and stats.free_blocks == 32


def test_a_failed_background_compile_publishes_one_record(gpt2):
    model, tok = gpt2
    engine = Engine(model, tok, n_blocks=8, block_size=4, compile_sizes=(1, 4), background_compile=True)
    decode = engine.runner.decode
    assert decode.state == CompileState(frozenset(), (1, 4), None)

    def fail(cache=None):
        decode.state = CompileState(frozenset({1}), (4,))  # size 1 compiled, as compile_now publishes it
        raise RuntimeError("no compiler")

    decode.compile_now = fail
    decode.compile_in_background().join()
    assert decode.state == CompileState(frozenset({1}), (), "RuntimeError: no compiler")
    assert decode.ready == {1} and decode.error == "RuntimeError: no compiler" and decode.padded_size(1) == 1
    assert EngineThread.compile_stats(SimpleNamespace(engine=engine)) == {
        "compiled_batch_sizes": [1], "compiling_batch_sizes": [], "compile_error": "RuntimeError: no compiler"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        decode.state.error = None
