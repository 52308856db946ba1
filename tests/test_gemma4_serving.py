"""Lesson 30: the engine and `hardway serve` with Gemma 4, whose cache layers differ in shape and whose shared layers
keep nothing.

A tiny random Gemma 4 (6 layers, the last 3 shared, a sliding window of 7, per-layer inputs) borrowing SmolLM2's
tokenizer: every greedy answer the engine gives, alone or among others, chunked, preempted, compiled or streamed,
must be token-identical to `hardway.generate` on that prompt alone. The pool holds the three layers that keep keys,
each in its shape; the sliding layers' blocks go back as the window passes; prefix caching is off for a model with
sliding layers (lesson 15).
"""
import json
import threading

import httpx
import pytest
import torch

from hardway.engine.block_manager import FREED, PrefixCachingBlockManager
from hardway.engine.config import EngineConfig
from hardway.engine.engine import Engine, PrefixCachingEngine
from hardway.engine.sequence import SamplingParams
from hardway.engine.shaped_cache import LayerShapedPagedCache
from hardway.errors import ConfigError
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer
from borrowed_tokenizer import save_with_smollm2_tokenizer, smollm2_vocab_size
from test_gemma4 import randomize  # sibling modules: pytest puts tests/ on the path
from test_qwen35_serving import TEXTS, alone  # its eight texts, and generate on one prompt alone

transformers = pytest.importorskip("transformers")

N_NEW = 10  # as alone's default
LENGTHS = (5, 70, 12, 130, 33, 1, 90, 47)  # most past the window of 7; several longer than a step's budget
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0, stop_token_ids=[])
S, F = "sliding_attention", "full_attention"


def random_gemma4(vocab_size: int):
    config = transformers.Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=7, max_position_embeddings=512,
        layer_types=[S, S, F] * 2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size,
        num_kv_shared_layers=3, final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return randomize(transformers.Gemma4ForCausalLM(config))  # every tensor random (lesson 30's)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Gemma 4 checkpoint folder with SmolLM2's tokenizer files."""
    out = tmp_path_factory.mktemp("gemma4")
    return save_with_smollm2_tokenizer(random_gemma4(smollm2_vocab_size()), out)


@pytest.fixture(scope="module")
def gemma4(folder):
    return load(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def prompts(gemma4):
    model, _ = gemma4
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(gemma4, prompts):
    return [alone(gemma4[0], p) for p in prompts]


def run(engine, prompts, params=GREEDY):
    """Every prompt added at once, stepped to the end -> (the sequences, steps that prefilled and decoded at once,
    the most sliding blocks one sequence held)."""
    seqs = [engine.add(p, params) for p in prompts]
    mixed, most_sliding = 0, 0
    while engine.has_work():
        prefilling = {s.n_cached < len(s.prompt_ids) for s in engine.running}
        engine.step()
        mixed += prefilling == {True, False}
        most_sliding = max([most_sliding] + [sum(b != FREED for b in s.sliding_table) for s in engine.running])
    return seqs, mixed, most_sliding


def test_the_pool_keeps_the_layers_that_keep_keys_each_in_its_shape(gemma4):
    model, tok = gemma4
    engine = Engine(model, tok, EngineConfig(n_blocks=16, block_size=8, max_batch=3))
    pool = engine.runner.cache
    assert isinstance(pool, LayerShapedPagedCache)
    assert pool.n_layers == 3 and pool.layer_shapes == [(2, 16), (2, 16), (2, 32)]  # layers 3..5 are shared: none
    assert pool.sliding == [True, True, False] and model.sliding_windows == (7, 7, None)
    assert [tuple(k.shape[1:]) for k in pool.k + pool.v] == [(2, 16), (2, 16), (2, 32)] * 2
    assert pool.k[2].shape[0] == 16 * 8 + 1 and pool.k[0].shape[0] == engine.sliding_blocks.n_blocks * 8 + 1
    assert pool.bytes_per_block() == 2 * 8 * 2 * 32 * 4 and pool.bytes_per_block(sliding=True) == 2 * 8 * 2 * 2 * 16 * 4


def test_eight_concurrent_greedy_requests_equal_generate_alone(gemma4, prompts, expected):
    model, tok = gemma4
    engine = Engine(model, tok, EngineConfig(n_blocks=128, block_size=4, max_batch=8, max_step_tokens=48))
    seqs, mixed, most_sliding = run(engine, prompts)
    assert all(s.finish_reason == "length" for s in seqs), [(s.finish_reason, s.error) for s in seqs]
    assert [s.output_ids for s in seqs] == expected
    assert mixed > 0  # prompts were prefilled beside decodes
    assert most_sliding <= engine.sliding_blocks.blocks_per_sequence(48)  # the window's blocks, not the sequence's
    assert engine.blocks.n_free == 128 and engine.sliding_blocks.n_free == engine.sliding_blocks.n_blocks


def test_a_pool_too_small_preempts_and_answers_stay_the_same(gemma4, prompts, expected):
    model, tok = gemma4
    engine = Engine(model, tok, EngineConfig(n_blocks=24, block_size=8, max_batch=8, max_step_tokens=48))
    seqs, _, _ = run(engine, prompts)
    assert engine.n_preemptions > 0
    assert [s.output_ids for s in seqs] == expected


def test_compiled_decode_steps_on_the_shaped_pool(gemma4, prompts, expected):
    model, tok = gemma4
    engine = Engine(model, tok, EngineConfig(n_blocks=128, block_size=8, max_batch=4, max_step_tokens=64,
                                             compile_sizes=(4,), backend="eager"))
    assert engine.runner.decode.ready == {4}
    seqs, _, _ = run(engine, prompts[:4])
    assert [s.output_ids for s in seqs] == expected[:4]


def test_prefix_caching_is_off_for_sliding_layers_and_int8_is_refused(gemma4, prompts, expected):
    """Lesson 15: a sliding layer's blocks of a shared prefix are handed back as the window passes them, so the engine
    builds its plain block manager for a model with sliding layers, whatever prefix_caching says."""
    model, tok = gemma4
    for engine in (Engine(model, tok, EngineConfig(n_blocks=64, block_size=8, prefix_caching=True)),
                   PrefixCachingEngine(model, tok, n_blocks=64, block_size=8)):
        assert not isinstance(engine.blocks, PrefixCachingBlockManager) and not engine.blocks.caches_prefixes
        seqs, _, _ = run(engine, [prompts[1], prompts[1][:50] + prompts[2]])
        assert seqs[0].output_ids == expected[1]
    with pytest.raises(ConfigError, match="kv_cache_dtype='auto'") as e:
        Engine(model, tok, EngineConfig(n_blocks=16, kv_cache_dtype="int8"))
    assert "\n" not in str(e.value)


# `hardway serve` in a subprocess, as tests/test_server.py starts it


@pytest.fixture(scope="module")
def server(folder):
    from test_server import Server  # a sibling module: pytest puts tests/ on the path
    s = Server(str(folder), "--device", "cpu", "--blocks", "128", "--block-size", "8", "--max-batch", "8",
               "--max-step-tokens", "32")
    yield s
    s.stop()


def test_serve_eight_concurrent_equal_alone_and_streamed_equals_whole(server, gemma4, folder):
    model, tok = gemma4
    eos = model.eos_token_ids
    want = [tok.decode(alone(model, tok.encode(t), N_NEW, eos)) for t in TEXTS]
    assert any(len(tok.encode(t)) > 32 for t in TEXTS)
    got, streamed = [None] * len(TEXTS), [None] * len(TEXTS)

    def ask(i):
        r = server.client.completions.create(model=str(folder), prompt=TEXTS[i], max_tokens=N_NEW, temperature=0)
        got[i] = r.choices[0].text
        parts = [c.choices[0].text for c in server.client.completions.create(
            model=str(folder), prompt=TEXTS[i], max_tokens=N_NEW, temperature=0, stream=True) if c.choices]
        streamed[i] = "".join(parts)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TEXTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want and streamed == want
    stats = server.wait_pool_full()
    assert stats["prefix_cache"] is False  # `hardway serve` asks for it; sliding layers: none (lesson 15)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"prompt": "Hi", "temperature": -1}, 400, "temperature"),
])
def test_serve_bad_input_is_a_4xx_in_openai_shape_and_serving_goes_on(server, folder, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps({"model": str(folder), **body}).encode()
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    r = server.client.completions.create(model=str(folder), prompt="Hi", max_tokens=2, temperature=0)
    assert r.choices[0].text is not None
