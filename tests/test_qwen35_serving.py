"""Lesson 28: the engine and `hardway serve` with a model that keeps a state (lesson 27's Qwen3.5).

A tiny random Qwen3.5 (3 Gated DeltaNet layers, 1 full attention) borrowing SmolLM2's tokenizer: every greedy answer
the engine gives, alone or among others, chunked, preempted, n at once, streamed or not, must be token-identical to
`hardway.generate` on that prompt alone; state slots come back; prefix caching is refused with its reason.
"""
import json
import threading

import httpx
import pytest
import torch

from hardway.decode.generate import generate
from hardway.engine.config import EngineConfig
from hardway.engine.engine import Engine, PrefixCachingEngine
from hardway.engine.sequence import SamplingParams
from hardway.engine.state_cache import PREFIX_CACHING_REFUSED, StatePagedCache, keeps_state
from hardway.errors import ConfigError
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer
from borrowed_tokenizer import save_with_smollm2_tokenizer, smollm2_vocab_size

transformers = pytest.importorskip("transformers")

N_NEW = 10
LENGTHS = (5, 70, 12, 130, 33, 1, 90, 47)  # several longer than a step's budget: prefilled in chunks
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0, stop_token_ids=[])


def random_qwen35(vocab_size: int):
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config)
    with torch.no_grad():  # every tensor random (lesson 27's randomize): a mistake in a norm or a gate shows
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 8).log())
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.normal_(0, 0.15)
    return model.eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint folder with SmolLM2's tokenizer files."""
    out = tmp_path_factory.mktemp("qwen3_5")
    return save_with_smollm2_tokenizer(random_qwen35(smollm2_vocab_size()), out)


@pytest.fixture(scope="module")
def qwen35(folder):
    return load(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def prompts(qwen35):
    model, _ = qwen35
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


def alone(model, ids, n=N_NEW, eos=()):
    """hardway.generate on one prompt by itself, cut before the first end-of-sequence token."""
    out = generate(model, torch.tensor([ids]), max_new_tokens=n, eos_token_id=None)[0, len(ids):].tolist()
    return out[:next((i for i, t in enumerate(out) if t in eos), len(out))]


@pytest.fixture(scope="module")
def expected(qwen35, prompts):
    return [alone(qwen35[0], p) for p in prompts]


def run(engine, prompts, params=GREEDY):
    """Every prompt added at once, stepped to the end -> (the sequences, steps that prefilled and decoded at once)."""
    seqs = [engine.add(p, params) for p in prompts]
    mixed = 0
    while engine.has_work():
        prefilling = {s.n_cached < len(s.prompt_ids) for s in engine.running}
        engine.step()
        mixed += prefilling == {True, False}
    return seqs, mixed


def test_the_model_is_seen_to_keep_a_state(qwen35):
    model, tok = qwen35
    assert keeps_state(model)
    engine = Engine(model, tok, EngineConfig(n_blocks=16, block_size=8, max_batch=3))
    assert isinstance(engine.runner.cache, StatePagedCache)
    assert engine.runner.cache.n_layers == 1 and len(engine.runner.cache.conv) == 3  # 1 attention layer, 3 states
    assert engine.runner.cache.conv[0].shape[0] == 3 and list(engine.scheduler.free_state_slots) == [0, 1, 2]


def test_eight_concurrent_greedy_requests_equal_generate_alone(qwen35, prompts, expected):
    model, tok = qwen35
    engine = Engine(model, tok, EngineConfig(n_blocks=128, block_size=8, max_batch=8, max_step_tokens=48))
    seqs, mixed = run(engine, prompts)
    assert all(s.finish_reason == "length" for s in seqs), [(s.finish_reason, s.error) for s in seqs]
    assert [s.output_ids for s in seqs] == expected
    assert mixed > 0  # prompts were prefilled beside decodes
    assert sorted(engine.scheduler.free_state_slots) == list(range(8)) and engine.blocks.n_free == 128


def test_chunks_of_one_token_carry_the_state(qwen35, prompts, expected):
    """max_step_tokens=7: the 130-token prompt is prefilled in 19 steps, the state carried from chunk to chunk."""
    model, tok = qwen35
    engine = Engine(model, tok, EngineConfig(n_blocks=64, block_size=8, max_batch=2, max_step_tokens=7))
    seqs, _ = run(engine, prompts[1:4])
    assert [s.output_ids for s in seqs] == expected[1:4]


def test_a_pool_too_small_preempts_and_answers_stay_the_same(qwen35, prompts, expected):
    model, tok = qwen35
    engine = Engine(model, tok, EngineConfig(n_blocks=20, block_size=8, max_batch=8, max_step_tokens=48))
    seqs, _ = run(engine, prompts)
    assert engine.n_preemptions > 0
    assert [s.output_ids for s in seqs] == expected
    assert sorted(engine.scheduler.free_state_slots) == list(range(8))


def test_a_preempted_or_aborted_sequence_gives_its_slot_back(qwen35, prompts):
    model, tok = qwen35
    engine = Engine(model, tok, EngineConfig(n_blocks=64, block_size=8, max_batch=2, max_step_tokens=48))
    a, b, c = (engine.add(p, GREEDY) for p in prompts[:3])
    engine.step()
    assert {a.state_slot, b.state_slot} == {0, 1} and c.state_slot is None  # max_batch 2: c waits, no slot
    engine.scheduler.preempt(b)
    assert b.state_slot is None and len(engine.scheduler.free_state_slots) == 1
    engine.abort(a)
    assert a.state_slot is None and len(engine.scheduler.free_state_slots) == 2
    while engine.has_work():
        engine.step()
    assert b.output_ids == alone(model, prompts[1]) and c.output_ids == alone(model, prompts[2])
    assert len(engine.scheduler.free_state_slots) == 2


def test_n_choices_each_get_a_slot_and_the_same_greedy_answer(qwen35, prompts, expected):
    model, tok = qwen35
    engine = Engine(model, tok, EngineConfig(n_blocks=64, block_size=8, max_batch=4, max_step_tokens=48))
    first = engine.add(prompts[0], GREEDY)
    others = [engine.add(prompts[0], GREEDY, share_prompt_with=first.id) for _ in range(2)]
    engine.step()  # all three prompts fit one step's budget
    assert len({s.state_slot for s in [first, *others]} - {None}) == 3
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in [first, *others]] == [expected[0]] * 3


def test_a_failed_pass_leaves_the_state_as_it_was(qwen35, prompts, expected, monkeypatch):
    """The batched pass raises once (after the model wrote its states): the engine computes each sequence alone,
    and the state the failed pass wrote must not have been kept."""
    model, tok = qwen35
    engine = Engine(model, tok, EngineConfig(n_blocks=64, block_size=8, max_batch=4, max_step_tokens=48))
    seqs = [engine.add(p, GREEDY) for p in prompts[:3]]
    for _ in range(4):
        engine.step()
    forward, calls = engine.runner.forward, []

    def fails_once(batch, n_new):
        logits = forward(batch, n_new)
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("the pass failed after the model ran")
        return logits

    monkeypatch.setattr(engine.runner, "forward", fails_once)
    while engine.has_work():
        engine.step()
    assert calls[:4] == [3, 1, 1, 1]
    assert [s.output_ids for s in seqs] == expected[:3]


def test_prefix_caching_is_refused_with_the_reason(qwen35):
    model, tok = qwen35
    for make in (lambda: Engine(model, tok, EngineConfig(n_blocks=16, prefix_caching=True)),
                 lambda: PrefixCachingEngine(model, tok, n_blocks=16)):
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value) == PREFIX_CACHING_REFUSED and "\n" not in str(e.value)
    assert "state after the prefix is not kept" in PREFIX_CACHING_REFUSED and "snapshots" in PREFIX_CACHING_REFUSED
    with pytest.raises(ConfigError, match="int8"):
        Engine(model, tok, EngineConfig(n_blocks=16, kv_cache_dtype="int8"))
    engine = Engine(model, tok, EngineConfig(n_blocks=16, compile_sizes=(1,)))  # a state: every step eager
    assert engine.runner.decode is None and engine.config.compile_sizes == ()


# `hardway serve` in a subprocess, as tests/test_server.py starts it


@pytest.fixture(scope="module")
def server(folder):
    from test_server import Server  # a sibling module: pytest puts tests/ on the path
    s = Server(str(folder), "--device", "cpu", "--blocks", "128", "--block-size", "8", "--max-batch", "8",
               "--max-step-tokens", "32")
    yield s
    s.stop()


TEXTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a", "def fib(n):", "1, 2, 3,",
         "A long prompt, longer than one step's budget of thirty-two tokens, so that the server prefills it in "
         "chunks while the other requests decode: " + "and then " * 8, "Hi", "Lists: apples, pears, plums, figs",
         "Why is the sky blue? Explain in the words of a child, then in the words of a physicist."]


def test_serve_eight_concurrent_equal_alone_and_streamed_equals_whole(server, qwen35, folder):
    model, tok = qwen35
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
    r = server.client.completions.create(model=str(folder), prompt=TEXTS[1], max_tokens=N_NEW, temperature=0, n=3)
    assert [c.text for c in r.choices] == [want[1]] * 3
    stats = server.wait_pool_full()
    assert stats["prefix_cache"] is False


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
