"""Lesson 31: the engine and `hardway serve` with gpt-oss (attention sinks, sliding layers beside full ones).

A tiny random gpt-oss (window 8, a sliding layer, a full one, a sliding one) borrowing SmolLM2's tokenizer: lesson 15's
engine gives its sliding layers their own pool; every greedy answer, alone or among others, streamed or whole, must
be token-identical to `hardway.generate` on that prompt alone. Prefix caching is off for a model with sliding layers
(lesson 15): a cached prefix's sliding blocks were handed back as the window moved past them.
"""
import threading

import httpx
import pytest
import torch

from hardway.decode.generate import generate
from hardway.engine.config import EngineConfig
from hardway.engine.engine import Engine, PrefixCachingEngine
from hardway.engine.sequence import SamplingParams
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer
from borrowed_tokenizer import save_with_smollm2_tokenizer, smollm2_vocab_size

transformers = pytest.importorskip("transformers")

N_NEW = 10
WINDOW = 8
LENGTHS = (5, 40, 12, 70, 23, 1, 50, 31)  # most longer than the window, several than a step's budget
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0, stop_token_ids=[])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_oss")
    vocab = smollm2_vocab_size()
    config = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=512, eos_token_id=2, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else \
                p.normal_(0, 0.3 if "sinks" in name or "bias" in name else 0.15)
    return save_with_smollm2_tokenizer(model, out)


@pytest.fixture(scope="module")
def gpt_oss(folder):
    return load(folder), load_tokenizer(folder)


def alone(model, ids, n=N_NEW, eos=()):
    out = generate(model, torch.tensor([ids]), max_new_tokens=n, eos_token_id=None)[0, len(ids):].tolist()
    return out[:next((i for i, t in enumerate(out) if t in eos), len(out))]


def test_eight_concurrent_requests_equal_generate_alone_in_a_sliding_pool(gpt_oss):
    model, tok = gpt_oss
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    engine = Engine(model, tok, EngineConfig(n_blocks=128, block_size=4, max_batch=8, max_step_tokens=32))
    assert engine.sliding_blocks is not None and engine.runner.cache.sliding == [True, False, True]
    seqs = [engine.add(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == [alone(model, p) for p in prompts]
    assert engine.blocks.n_free == 128


def test_prefix_caching_is_off_for_a_model_with_sliding_layers(gpt_oss):
    model, tok = gpt_oss
    engine = PrefixCachingEngine(model, tok, n_blocks=64, block_size=4)
    assert engine.sliding_blocks is not None and not engine.blocks.caches_prefixes


@pytest.fixture(scope="module")
def server(folder):
    from test_server import Server  # a sibling module: pytest puts tests/ on the path
    s = Server(str(folder), "--device", "cpu", "--blocks", "128", "--block-size", "8", "--max-batch", "8",
               "--max-step-tokens", "32")
    yield s
    s.stop()


TEXTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a", "def fib(n):", "1, 2, 3,",
         "A long prompt, longer than one step's budget of thirty-two tokens and than the window: " + "and then " * 8,
         "Hi", "Lists: apples, pears, plums, figs", "Why is the sky blue? Explain in the words of a child."]


def test_serve_eight_concurrent_equal_alone_streamed_equals_whole_and_bad_input_is_400(server, gpt_oss, folder):
    model, tok = gpt_oss
    want = [tok.decode(alone(model, tok.encode(t), N_NEW, model.eos_token_ids)) for t in TEXTS]
    got, streamed = [None] * len(TEXTS), [None] * len(TEXTS)

    def ask(i):
        r = server.client.completions.create(model=str(folder), prompt=TEXTS[i], max_tokens=N_NEW, temperature=0)
        got[i] = r.choices[0].text
        streamed[i] = "".join(c.choices[0].text for c in server.client.completions.create(
            model=str(folder), prompt=TEXTS[i], max_tokens=N_NEW, temperature=0, stream=True) if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TEXTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want and streamed == want
    r = httpx.post(server.url + "/v1/completions", json={"model": str(folder), "prompt": "Hi", "max_tokens": 0},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert server.wait_pool_full()["prefix_cache"] is False
