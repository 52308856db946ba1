"""generate (lesson 08) against transformers' generate on the GPT-2 stand-in, and the KV cache's rules."""

import pytest
import torch
import torch.nn.functional as F

from hardway.decode.generate import generate
from hardway.models.kv_cache import KVCache, KVCacheFullError
from hardway.decode.sampling import GREEDY, SamplingConfig

GPT2 = "openai-community/gpt2"
PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 780]  # "The quick brown fox jumps over the lazy dog because"
PROMPT_2 = [7454, 2402, 257, 640, 612, 373, 257, 1310, 2576, 508]  # "Once upon a time there was a little girl who"


@pytest.fixture(scope="module")
def ours():
    from hardway.loading import load

    return load(GPT2)  # fp32


@pytest.fixture(scope="module")
def reference():
    from transformers import GPT2LMHeadModel

    from hardway.formats.hub import checkpoint

    return GPT2LMHeadModel.from_pretrained(checkpoint(GPT2), dtype=torch.float32).eval()


def hf_generate(reference, input_ids, **kwargs):
    """transformers' generate with our defaults spelled out: GPT-2's EOS (50256) pads finished rows, as it does when
    pad_token_id is unset; every prompt position is real (no padding)."""
    kwargs.setdefault("pad_token_id", kwargs.get("eos_token_id", 50256) or 50256)
    with torch.inference_mode():
        return reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)


def prompt(*rows):
    return torch.tensor([list(r) for r in rows] or [PROMPT])  # (B, T)


def test_prompt_ids_are_what_the_comments_say():
    from transformers import AutoTokenizer

    from hardway.formats.hub import checkpoint

    tok = AutoTokenizer.from_pretrained(checkpoint(GPT2))
    assert tok.encode("The quick brown fox jumps over the lazy dog because") == PROMPT
    assert tok.encode("Once upon a time there was a little girl who") == PROMPT_2


@pytest.fixture(scope="module")
def greedy50(ours):
    """Our 50 greedy tokens after PROMPT with GPT-2's EOS rule, (1, 10 + 50); reused to keep the tests short."""
    return generate(ours, prompt(), max_new_tokens=50)


def test_50_greedy_tokens_equal_transformers(ours, reference, greedy50):
    ids = prompt()
    b = hf_generate(reference, ids, max_new_tokens=50, do_sample=False)  # eos 50256 from GPT-2's config
    assert ours.eos_token_ids == [50256]
    assert greedy50.shape == b.shape, f"ours {tuple(greedy50.shape)} vs transformers {tuple(b.shape)}"
    n = ids.shape[1]
    assert torch.equal(greedy50, b), f"{int((greedy50[0, n:] == b[0, n:]).sum())}/50 new tokens identical"
    assert torch.equal(greedy50[:, :n], ids), "the prompt is part of the output"


def test_naive_equals_cached_greedy_and_sampled(ours, greedy50):
    ids = prompt()
    assert greedy50.shape == (1, 60), "greedy run stopped early at an EOS; the slices below assume 50 tokens"
    naive = generate(ours, ids, max_new_tokens=20, eos_token_id=None, use_cache=False)
    assert torch.equal(naive, greedy50[:, :30])
    assert torch.equal(generate(ours, ids, max_new_tokens=20, eos_token_id=None), naive)
    sampling = SamplingConfig(do_sample=True, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.2)
    sampled_cached = generate(ours, ids, 8, sampling, generator=torch.Generator().manual_seed(5), eos_token_id=None)
    sampled_naive = generate(ours, ids, 8, sampling, generator=torch.Generator().manual_seed(5), use_cache=False,
                             eos_token_id=None)
    assert torch.equal(sampled_cached, sampled_naive)


def test_seeded_sampling_is_reproducible_and_equals_transformers_with_the_same_global_seed(ours, reference):
    ids = prompt()
    settings = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3)
    sampling = SamplingConfig(**settings)
    a = generate(ours, ids, 10, sampling, generator=torch.Generator().manual_seed(1))
    b = generate(ours, ids, 10, sampling, generator=torch.Generator().manual_seed(1))
    c = generate(ours, ids, 10, sampling, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(1234)
    ours_global = generate(ours, ids, 10, sampling)  # generator=None: torch's global RNG, as transformers
    torch.manual_seed(1234)
    theirs = hf_generate(reference, ids, max_new_tokens=10, **settings)
    assert torch.equal(ours_global, theirs)


def test_min_p_keyword_samples_as_transformers_min_p(ours, reference):
    """min_p is a generate keyword in transformers too: the same global seed, the same tokens; and it matters here."""
    ids = prompt()
    settings = dict(do_sample=True, temperature=1.5, top_k=0, min_p=0.2)
    torch.manual_seed(7)
    ours_min_p = generate(ours, ids, 12, eos_token_id=None, **settings)
    torch.manual_seed(7)
    theirs = hf_generate(reference, ids, max_new_tokens=12, eos_token_id=None, **settings)
    assert torch.equal(ours_min_p, theirs)
    torch.manual_seed(7)
    without = generate(ours, ids, 12, eos_token_id=None, do_sample=True, temperature=1.5, top_k=0)
    assert not torch.equal(ours_min_p, without), "min_p changed nothing: the comparison would be vacuous"
    assert generate(ours, ids, 12, SamplingConfig(True, 1.5, 0, min_p=0.2), generator=torch.Generator().manual_seed(3),
                    eos_token_id=None).tolist() == \
        generate(ours, ids, 12, generator=torch.Generator().manual_seed(3), eos_token_id=None, **settings).tolist()


def test_repetition_penalty_applies_in_greedy_mode_like_transformers(ours, reference, greedy50):
    ids = prompt()
    a = generate(ours, ids, 12, SamplingConfig(repetition_penalty=1.5), eos_token_id=None)
    b = hf_generate(reference, ids, max_new_tokens=12, do_sample=False, repetition_penalty=1.5, eos_token_id=None)
    assert torch.equal(a, b)
    assert not torch.equal(a, greedy50[:, :22]), "the penalty changed nothing: the test would be vacuous"


def first_new_token_at_or_after(seq, step):
    """(step, id) of the first generated token at index >= step that did not occur earlier in seq."""
    for i in range(step, len(seq)):
        if seq[i] not in seq[:i]:
            return i, seq[i]
    pytest.fail(f"greedy output {seq} has no new token at or after step {step} to use as EOS")


def test_eos_stopping_rule_equals_transformers(ours, reference, greedy50):
    ids = prompt()
    n = ids.shape[1]
    step, eos = first_new_token_at_or_after(greedy50[0, n:].tolist(), 5)
    a = generate(ours, ids, 50, eos_token_id=eos)
    b = hf_generate(reference, ids, max_new_tokens=50, do_sample=False, eos_token_id=eos)
    assert a.shape == (1, n + step + 1), "must stop right after the first EOS, keeping it"
    assert a[0, -1].item() == eos
    assert torch.equal(a, b)
    # a list of EOS ids: the first of them to appear stops generation
    a = generate(ours, ids, 50, eos_token_id=[12345, eos])
    b = hf_generate(reference, ids, max_new_tokens=50, do_sample=False, eos_token_id=[12345, eos], pad_token_id=12345)
    assert a.shape == (1, n + step + 1) and torch.equal(a, b)


def test_batch_of_two_equals_transformers_and_pads_finished_rows_like_it(ours, reference, greedy50):
    ids = prompt(PROMPT, PROMPT_2)
    n = ids.shape[1]
    a = generate(ours, ids, 16)
    b = hf_generate(reference, ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(a, b)
    assert a.shape == (2, n + 16), "a row emitted GPT-2's EOS; the EOS case below assumes none did"
    assert torch.equal(a[0:1], greedy50[:, :n + 16]), "row 0 of the batch differs from the same prompt alone"
    # EOS in a batch: a token only row 0 generates finishes row 0 early; row 1 runs on; row 0 is padded with the EOS
    free = a[:, n:].tolist()  # (2, 16)
    candidates = [(i, t) for i, t in enumerate(free[0]) if t not in free[0][:i] and t not in free[1]]
    assert candidates, f"no token that only row 0 generates: {free}"
    step, eos = candidates[0]
    a = generate(ours, ids, 16, eos_token_id=eos)
    b = hf_generate(reference, ids, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    assert a.shape == (2, n + 16), "row 1 never emits EOS, so the batch runs the full length"
    assert (a[0, n + step:] == eos).all(), "row 0 ends with its EOS followed by EOS padding"
    assert torch.equal(a[1], torch.tensor(PROMPT_2 + free[1])), "row 1 is unaffected by row 0 finishing"
    assert torch.equal(a, b)


def test_prompt_plus_new_tokens_beyond_context_raises_before_any_work(ours):
    calls = []

    class Spy:  # the model interface, recording every call
        max_seq_len, eos_token_ids = ours.max_seq_len, ours.eos_token_ids

        def __call__(self, *args, **kwargs):
            calls.append("forward")
            return ours(*args, **kwargs)

        def new_kv_cache(self, *args):
            calls.append("new_kv_cache")
            return ours.new_kv_cache(*args)

    ids = torch.zeros(1, 1000, dtype=torch.long)
    with pytest.raises(ValueError, match=r"1000.*100.*1100.*1024"):
        generate(Spy(), ids, max_new_tokens=100)
    assert calls == [], "the error must come before any model call or cache allocation"


@pytest.mark.parametrize("bad", [
    dict(input_ids=torch.tensor(PROMPT)),  # 1-D
    dict(input_ids=torch.tensor([PROMPT], dtype=torch.float32)),
    dict(input_ids=torch.zeros(1, 0, dtype=torch.long)),
    dict(max_new_tokens=0),
    dict(max_new_tokens=-3),
    dict(sampling=dict(do_sample=True)),  # the settings must come as a SamplingConfig
])
def test_bad_arguments_raise_value_error(bad):
    kwargs = dict(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4) | bad
    with pytest.raises(ValueError):
        generate(TinyLM(), **kwargs)


@pytest.mark.parametrize("bad, message", [
    (dict(do_sample=True, temperature=0.0), "temperature must be a positive number"),
    (dict(do_sample=True, top_p=1.5), "top_p must be a number in"),
    (dict(top_k=-1), "top_k"),  # checked even when greedy: a mistake is an error, not ignored
    (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_sampling_config_checks_every_value_when_made(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**bad)


def test_sampling_config_from_temperature_zero_is_greedy():
    assert SamplingConfig.from_temperature(0) == GREEDY and not GREEDY.processors()
    sampled = SamplingConfig.from_temperature(0.7, top_k=5, top_p=0.9)
    assert sampled == SamplingConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
    assert [type(p).__name__ for p in sampled.processors()] == ["TemperatureLogitsWarper", "TopKLogitsWarper",
                                                                "TopPLogitsWarper"]
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        SamplingConfig.from_temperature(-1)


# --- generation mechanics on a tiny model with the same interface (no checkpoint needed) ---

class TinyLM(torch.nn.Module):
    """A one-layer causal attention model with the course's model interface: model(ids, kv_cache, start_pos)."""

    def __init__(self, vocab_size=50, d=16, n_head=2, max_seq_len=32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.wte = torch.nn.Parameter(torch.randn(vocab_size, d, generator=g) * 0.3)
        self.wpe = torch.nn.Parameter(torch.randn(max_seq_len, d, generator=g))
        self.qkv = torch.nn.Parameter(torch.randn(d, 3 * d, generator=g) / d**0.5)
        self.n_head, self.head_dim = n_head, d // n_head
        self.max_seq_len, self.eos_token_ids = max_seq_len, []

    def new_kv_cache(self, batch_size, max_len):
        return KVCache(1, batch_size, max_len, self.n_head, self.head_dim)

    def forward(self, input_ids, kv_cache=None, start_pos=0, last_only=False):
        B, T = input_ids.shape
        x = self.wte[input_ids] + self.wpe[start_pos:start_pos + T]  # (B, T, d)
        q, k, v = (x @ self.qkv).split(x.shape[-1], dim=-1)  # 3 x (B, T, d)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        if kv_cache is not None:
            k, v = kv_cache.update(0, start_pos, k, v)  # (B, H, start_pos + T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)  # (B, H, T, hd)
        x = x + y.transpose(1, 2).reshape(B, T, -1)  # (B, T, d)
        return (x[:, -1:] if last_only else x) @ self.wte.T  # (B, T or 1, V)


def test_tiny_model_fills_the_context_exactly_and_one_more_is_an_error():
    model = TinyLM()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    full = generate(model, ids, max_new_tokens=27)  # 5 + 27 = 32 = max_seq_len
    assert full.shape == (2, 32)
    assert torch.equal(full, generate(model, ids, max_new_tokens=27, use_cache=False))
    with pytest.raises(ValueError, match=r"5 tokens.*28.*33.*32"):
        generate(model, ids, max_new_tokens=28)


def test_on_token_streams_every_new_token():
    model = TinyLM()
    ids = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(1))
    seen = []
    out = generate(model, ids, max_new_tokens=10, on_token=lambda t: seen.append(t.clone()))
    assert len(seen) == 10 and all(t.shape == (2,) for t in seen)
    assert torch.equal(torch.stack(seen, dim=1), out[:, 4:])


def test_kv_cache_update_writes_in_place_and_returns_views():
    cache = KVCache(n_layers=2, batch_size=1, max_len=6, n_kv_heads=3, head_dim=4)
    assert cache.k.shape == cache.v.shape == (2, 1, 3, 6, 4)
    k, v = torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4)
    k_all, v_all = cache.update(1, 0, k, v)
    assert k_all.shape == (1, 3, 4, 4) and torch.equal(k_all, k) and torch.equal(v_all, v)
    k1, v1 = torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    k_all, v_all = cache.update(1, 4, k1, v1)
    assert k_all.shape == (1, 3, 5, 4)
    assert torch.equal(k_all[:, :, :4], k) and torch.equal(v_all[:, :, 4:], v1)
    assert k_all.data_ptr() == cache.k[1].data_ptr(), "update must return a view, not a copy"
    assert cache.k[0].abs().sum() == 0, "layer 0 untouched"
    assert cache.bytes_per_token == 2 * 2 * 3 * 4 * 4
    assert cache.nbytes == 2 * 2 * 3 * 6 * 4 * 4


def test_kv_cache_overflow_is_a_clear_error():
    cache = KVCache(n_layers=1, batch_size=1, max_len=6, n_kv_heads=2, head_dim=4)
    with pytest.raises(KVCacheFullError, match=r"6 positions.*2 token.*start_pos 5.*7"):
        cache.update(0, 5, torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    assert issubclass(KVCacheFullError, ValueError)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        cache.update(0, 0, torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))  # wrong head count
    with pytest.raises(ValueError, match="max_len"):
        KVCache(1, 1, 0, 2, 4)


def test_model_with_a_too_small_cache_raises_a_value_error(ours):
    cache = ours.new_kv_cache(1, 8)
    with pytest.raises(ValueError):
        ours(prompt(), kv_cache=cache, start_pos=0)  # 10 tokens into an 8-position cache
