"""Lesson 29: the engine and `hardway serve` with latent attention (DeepSeek-V3).

A tiny random DeepSeek-V3 (one dense layer, one with experts) borrowing SmolLM2's tokenizer: its pool holds latents
(LatentPagedCache, no values); every greedy answer the engine gives, alone or among others, chunked, preempted, with
a prefix cache, compiled, streamed or not, must be token-identical to `hardway.generate` on that prompt alone.
"""
import json
import threading

import httpx
import pytest
import torch

from hardway.engine.config import EngineConfig
from hardway.engine.engine import Engine, PrefixCachingEngine
from hardway.engine.latent_cache import LatentPagedCache
from hardway.errors import ConfigError
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer
from borrowed_tokenizer import save_with_smollm2_tokenizer, smollm2_vocab_size
from test_deepseek_v3 import TINY, randomize  # sibling modules: pytest puts tests/ on the path
from test_qwen35_serving import N_NEW, TEXTS, alone, run  # eight texts, generate alone, the engine run to the end

transformers = pytest.importorskip("transformers")

LENGTHS = (5, 70, 12, 130, 33, 1, 90, 47)  # several longer than a step's budget: prefilled in chunks


def random_deepseek_v3(vocab_size: int):
    """Two layers (a dense one, then one with 8 experts in 4 groups), every tensor random, the router's bias too."""
    torch.manual_seed(0)
    return randomize(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**TINY, "vocab_size": vocab_size, "num_hidden_layers": 2})))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint folder with SmolLM2's tokenizer files."""
    out = tmp_path_factory.mktemp("deepseek_v3")
    return save_with_smollm2_tokenizer(random_deepseek_v3(smollm2_vocab_size()), out)


@pytest.fixture(scope="module")
def deepseek(folder):
    return load(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def prompts(deepseek):
    model, _ = deepseek
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(deepseek, prompts):
    return [alone(deepseek[0], p) for p in prompts]


def test_the_pool_holds_latents_only(deepseek):
    model, tok = deepseek
    engine = Engine(model, tok, EngineConfig(n_blocks=16, block_size=8, max_batch=3))
    cache = engine.runner.cache
    assert isinstance(cache, LatentPagedCache) and cache.v == []
    assert [tuple(k.shape) for k in cache.k] == [(16 * 8 + 1, 1, 24 + 8)] * 2  # r + d_rope per slot, 2 layers
    assert cache.bytes_per_block() == 2 * 8 * 32 * 4  # layers x positions x numbers x fp32
    with pytest.raises(ConfigError, match="latent attention"):
        Engine(model, tok, EngineConfig(n_blocks=16, kv_cache_dtype="int8"))


def test_eight_concurrent_greedy_requests_equal_generate_alone(deepseek, prompts, expected):
    model, tok = deepseek
    engine = Engine(model, tok, EngineConfig(n_blocks=128, block_size=8, max_batch=8, max_step_tokens=48))
    seqs, _ = run(engine, prompts)
    assert all(s.finish_reason == "length" for s in seqs), [(s.finish_reason, s.error) for s in seqs]
    assert [s.output_ids for s in seqs] == expected
    assert engine.blocks.n_free == 128


def test_a_pool_too_small_preempts_and_answers_stay_the_same(deepseek, prompts, expected):
    model, tok = deepseek
    engine = Engine(model, tok, EngineConfig(n_blocks=20, block_size=8, max_batch=8, max_step_tokens=48))
    seqs, _ = run(engine, prompts)
    assert engine.n_preemptions > 0
    assert [s.output_ids for s in seqs] == expected


def test_prefix_caching_shares_latent_blocks(deepseek, prompts, expected):
    """Blocks are blocks: a second request with the first's prompt plus more reads the first's latent blocks."""
    model, tok = deepseek
    engine = PrefixCachingEngine(model, tok, n_blocks=64, block_size=8, max_batch=4, max_step_tokens=64)
    first = run(engine, [prompts[3]])[0][0]
    longer = prompts[3] + prompts[2]
    second = run(engine, [longer])[0][0]
    assert first.output_ids == expected[3] and second.output_ids == alone(model, longer)
    assert engine.scheduler.n_shared_tokens >= len(prompts[3]) // 8 * 8


def test_the_compiled_decode_step_gives_the_same_tokens(deepseek, prompts, expected):
    """Lesson 14's CompiledDecode through dynamo (the "eager" backend: traced, not compiled by inductor)."""
    model, tok = deepseek
    engine = Engine(model, tok, EngineConfig(n_blocks=64, block_size=8, max_batch=2, compile_sizes=(2,),
                                             backend="eager"))
    engine.runner.decode.compile_now()
    seqs, _ = run(engine, prompts[:2])
    assert [s.output_ids for s in seqs] == expected[:2]


# `hardway serve` in a subprocess, as tests/test_server.py starts it


@pytest.fixture(scope="module")
def server(folder):
    from test_server import Server  # a sibling module: pytest puts tests/ on the path
    s = Server(str(folder), "--device", "cpu", "--blocks", "128", "--block-size", "8", "--max-batch", "8",
               "--max-step-tokens", "32", "--eager")
    yield s
    s.stop()


def test_serve_eight_concurrent_equal_alone_and_streamed_equals_whole(server, deepseek, folder):
    model, tok = deepseek
    eos = model.eos_token_ids
    want = [tok.decode(alone(model, tok.encode(t), N_NEW, eos)) for t in TEXTS]
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
    assert stats["prefix_cache"] is True


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"prompt": "Hi", "max_tokens": 10_000}, 400, "max_tokens"),
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
