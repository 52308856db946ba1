"""Lesson 12's fast decode path: every speed-up must leave the tokens exactly as they were.

Speed itself is never tested here (benchmarks/decode.py measures it). What is tested: the head on the last position
only gives the full forward's last row; the column-by-column weight layout gives the row-by-row layout's tokens;
hardway.generate (preallocated, last_only prefill, no processors when greedy) gives the naive loop's tokens and
transformers'; the static-shape compiled decode step (lesson 12: a cache seen whole, a mask row, the position as a
tensor) gives eager's tokens from ONE compiled graph for prompts of several lengths, on GPT-2 and Llama tiny configs
and the SmolLM2 stand-in (compilations counted by a counting backend around "aot_eager"; lowered once by inductor to
CPU code; by the default CPU backend, whose one-row matmuls are streaming multiply-and-sum loops over matrices stored
row by row; with inductor and CUDA graphs when CUDA is present, skipped otherwise), while lesson 08's growing cache hands
the compiled graph a new signature at every position. Matrices on 2 MB pages keep their values, and the roofline
counts their bytes, not their maps'.
"""

import shutil

import pytest
import torch
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from torch._dynamo.testing import CompileCounterWithBackend

from hardway.kernels.layout import HUGE_PAGE, decode_layout, empty_on_huge_pages
from hardway.decode.static import StaticDecodeStep, StaticKVCache
from hardway.instruments.roofline import measure_bandwidth, measure_read_bandwidth, roofline_tokens_per_s
from hardway.instruments.agreement import teacher_forced_agreement
from hardway.decode.generate import Decoder, decode_one_token, generate, prefill
from hardway.models.kv_cache import KVCache, KVCacheFullError
from hardway.loading import load
from hardway.instruments.memory import weight_bytes
from hardway.instruments.timing import time_interleaved


def save_tiny_models(tmp_path_factory, positions: int = 64) -> dict:
    """A seeded random 2-layer GPT-2 and Llama (GQA, tied head), saved by transformers; {name: (folder, reference)}."""
    out = {}
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(HFGPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=positions, vocab_size=100)).eval()
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=positions, tie_word_embeddings=True)).eval()
    for name, model in (("gpt2", gpt2), ("llama", llama)):
        with torch.no_grad():  # larger than the default init, so that the logits are far from uniform
            for p in model.parameters():
                p.normal_(0, 0.3) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(folder)
        out[name] = (folder, model)
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return save_tiny_models(tmp_path_factory)


def prompt(vocab, B=1, T=7, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def row_major_copy(model):
    """The same model with every matrix stored row by row again (the layout before decode_layout)."""
    import copy

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for module in twin.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.dim() == 2:
                    p.data = p.data.contiguous()
    if hasattr(twin, "lm_head") and twin.config.tie_word_embeddings:
        twin.lm_head.weight = twin.tok_emb.weight
    return twin


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_last_only_is_the_full_forwards_last_row(tiny_models, name):
    folder, _ = tiny_models[name]
    model = load(folder)
    ids = prompt(100, B=2, T=9)
    with torch.inference_mode():
        full = model(ids)  # (2, 9, V)
        last = model(ids, last_only=True)  # (2, 1, V)
    assert last.shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=0, atol=1e-5)


def laid_out_for_decode(p):
    """Contiguous along the longer side: column by column when out >= in, row by row when in > out."""
    out_features, in_features = p.shape
    return p.stride() == ((1, out_features) if out_features >= in_features else (in_features, 1))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cpu_fp32_loaders_store_matrices_along_their_longer_side(tiny_models, name):
    folder, _ = tiny_models[name]
    model = load(folder)
    if name == "llama":
        assert model.lm_head.weight is model.tok_emb.weight  # still tied: one tensor, read once
        matrices = [p for p in model.parameters() if p.dim() == 2]
    else:
        matrices = [p for p in model.parameters() if p.dim() == 2]  # the blocks' projections, wte (the head) and wpe
    assert matrices and all(laid_out_for_decode(p) for p in matrices)
    assert any(p.stride()[0] == 1 for p in matrices) and any(p.stride()[1] == 1 for p in matrices)  # both kinds occur
    assert load(folder, dtype=torch.bfloat16).parameters().__next__().is_contiguous()  # bf16 keeps the file's layout


def test_decode_layout_keeps_shape_and_values():
    wide, tall = torch.randn(5, 3), torch.randn(3, 5)
    d = decode_layout(wide)
    assert d.shape == wide.shape and torch.equal(d, wide) and d.stride() == (1, 5) and not d.is_contiguous()
    d = decode_layout(tall)
    assert d.shape == tall.shape and torch.equal(d, tall) and d.is_contiguous()


def test_decode_layout_of_large_matrices_on_2mb_aligned_memory_that_outlives_its_map():
    import gc
    import sys

    wide, tall = torch.randn(1024, 768), torch.randn(768, 3072)  # 3 MB and 9 MB: big enough for huge pages
    d_wide, d_tall = decode_layout(wide), decode_layout(tall)
    gc.collect()  # the maps are referenced only through the tensors now: they must stay mapped
    assert torch.equal(d_wide, wide) and d_wide.stride() == (1, 1024)
    assert torch.equal(d_tall, tall) and d_tall.stride() == (3072, 1)
    if sys.platform == "linux":  # elsewhere it is plain torch.empty
        assert d_wide.data_ptr() % HUGE_PAGE == 0 and d_tall.data_ptr() % HUGE_PAGE == 0
    small = empty_on_huge_pages((3, 4), torch.bfloat16)  # below 2 MB: an ordinary tensor
    assert small.shape == (3, 4) and small.dtype == torch.bfloat16 and small.is_contiguous()


def test_weight_bytes_counts_tensors_not_their_maps():
    """A matrix on huge pages sits in a map with up to 2 MB of slack; the roofline must count only its own bytes."""
    module = torch.nn.Module()
    module.big = torch.nn.Parameter(decode_layout(torch.randn(2048, 1024)))  # 8 MiB in a larger map
    module.tied = torch.nn.Parameter(module.big.data)  # another Parameter on the same memory (a tie): read once
    module.bias = torch.nn.Parameter(torch.zeros(7))
    assert module.big.untyped_storage().nbytes() > module.big.nbytes  # the slack exists ...
    assert weight_bytes(module) == 4 * (2048 * 1024 + 7)  # ... and is not counted


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_layouts_give_the_same_tokens(tiny_models, name):
    folder, _ = tiny_models[name]
    fast = load(folder)
    slow = row_major_copy(fast)
    assert next(p for p in slow.parameters() if p.dim() == 2).is_contiguous()
    ids = prompt(100, B=2, T=5, seed=3)
    with torch.inference_mode():
        delta = (fast(ids) - slow(ids)).abs().max().item()
    assert delta < 1e-4, f"max |Δ logits| between layouts = {delta:.2e}"
    assert torch.equal(generate(fast, ids, 40, eos_token_id=None), generate(slow, ids, 40, eos_token_id=None))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fast_generate_equals_naive_loop_and_transformers(tiny_models, name):
    folder, reference = tiny_models[name]
    model = load(folder)
    ids = prompt(100, B=1, T=6, seed=1)
    fast = generate(model, ids, 40, eos_token_id=None)
    naive = generate(model, ids, 40, eos_token_id=None, use_cache=False)
    with torch.inference_mode():
        theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    assert torch.equal(fast, naive) and torch.equal(fast, theirs)


def test_generate_prefills_once_then_decodes_one_token_at_a_position_tensor(tiny_models):
    """The one decode path: prefill (the whole prompt, last_only, at position tensor 0), then decode_one_token once
    per new token at a 0-dim position tensor; a given decoder's cache is used, none other allocated."""
    folder, _ = tiny_models["llama"]
    model = load(folder)
    calls, allocations = [], []

    class Spy(torch.nn.Module):  # the model interface, recording how generate calls it
        max_seq_len, eos_token_ids = model.max_seq_len, []

        def forward(self, input_ids, kv_cache=None, start_pos=0, last_only=False):
            assert isinstance(start_pos, torch.Tensor) and start_pos.dim() == 0, f"start_pos {start_pos!r}"
            calls.append((input_ids.shape[1], int(start_pos), last_only))
            return model(input_ids, kv_cache=kv_cache, start_pos=start_pos, last_only=last_only)

        def new_kv_cache(self, batch_size, max_len):
            allocations.append((batch_size, max_len))
            return model.new_kv_cache(batch_size, max_len)

    spy, ids = Spy(), prompt(100, T=6)
    decoder = Decoder(spy, batch_size=1, max_len=20)
    out = generate(spy, ids, 5, eos_token_id=None, decoder=decoder)
    assert calls == [(6, 0, True)] + [(1, 6 + i, False) for i in range(4)]  # one prefill, then one token per step
    assert allocations == [(1, 20)]  # the decoder's, once: generate allocated nothing
    assert torch.equal(out, generate(model, ids, 5, eos_token_id=None))
    with pytest.raises(ValueError, match="the decoder's cache holds batch 1 x 20"):
        generate(model, ids, 15, decoder=decoder)  # 6 + 15 > 20


def test_prefill_and_decode_one_token_are_the_full_forward(tiny_models):
    """Lesson 08's two pieces by hand, at position tensors: each step's logits equal the uncached forward's row."""
    model = load(tiny_models["gpt2"][0])
    ids = prompt(100, T=9, seed=6)
    with torch.inference_mode():
        full = model(ids)  # (1, 9, V)
        cache = model.new_kv_cache(1, 9)
        logits = [prefill(model, ids[:, :5], cache)[:, -1]]
        logits += [decode_one_token(model, ids[:, p:p + 1], torch.tensor(p), cache)[:, -1] for p in range(5, 9)]
    assert (torch.stack(logits, 1) - full[:, 4:]).abs().max() < 1e-5


def counted_step(model, max_len, backend="aot_eager"):
    """A StaticDecodeStep whose torch.compile backend counts the graphs it is handed (dynamo's compilations)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    return StaticDecodeStep(model, max_len=max_len, backend=counter), counter


def assert_static_step_gives_eager_tokens(model, vocab, prompt_lengths=(1, 4, 9), new_tokens=12, backend="aot_eager"):
    """Prompts of several lengths through one StaticDecodeStep: eager's tokens every time, from one compiled graph."""
    step, counter = counted_step(model, max_len=max(prompt_lengths) + new_tokens, backend=backend)
    for T in prompt_lengths:
        ids = prompt(vocab, T=T, seed=T)
        eager = generate(model, ids, new_tokens, eos_token_id=None)
        static = step.generate(ids, new_tokens, eos_token_id=None)
        assert torch.equal(static, eager), f"prompt of {T} tokens: static {static[0, T:].tolist()} != eager {eager[0, T:].tolist()}"
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for {len(prompt_lengths)} prompt lengths"
    return step


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_static_step_is_one_graph_with_eager_tokens_on_tiny_models(tiny_models, name):
    """The static-shape step (a cache seen whole, a mask row, the position as a tensor), traced by dynamo and
    functionalized by AOTAutograd as inductor would receive it, run without code generation: cheap enough for CI."""
    folder, _ = tiny_models[name]
    step = assert_static_step_gives_eager_tokens(load(folder), vocab=100)
    assert step.generate(prompt(100, T=4, seed=4), 12, eos_token_id=None).shape == (1, 16)  # a 4th call: still one graph


def test_static_step_is_one_graph_with_eager_tokens_on_smollm2_standin():
    """Real weights, 30 layers: dynamo's graph run as captured ("eager"; AOTAutograd over 30 layers costs minutes)."""
    from hardway.formats.hub import checkpoint

    model = load(checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert_static_step_gives_eager_tokens(model, vocab=model.config.vocab_size, prompt_lengths=(1, 6, 13), new_tokens=8,
                                          backend="eager")


def test_the_growing_cache_gives_a_new_signature_at_every_position(tiny_models):
    """Why the static cache: compiled with dynamic=True on lesson 08's cache, the graph is called with a different key
    length (a different int) at every step, and a CUDA graph is recorded per distinct value."""
    torch._dynamo.reset()
    signatures = set()

    def recorder(graph_module, example_inputs):
        def run(*args):
            signatures.add(tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))
            return graph_module(*args)
        return run

    model = load(tiny_models["llama"][0])
    ids = prompt(100, T=5)
    compiled = torch.compile(model, backend=recorder, fullgraph=True, dynamic=True)
    cache = model.new_kv_cache(1, 15)
    with torch.inference_mode():  # greedy by hand, the position a Python int: the view's length is the int
        logits, out = model(ids, kv_cache=cache, start_pos=0, last_only=True), ids
        for pos in range(5, 15):
            out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)  # (1, pos + 1)
            if pos < 14:
                logits = compiled(out[:, -1:], kv_cache=cache, start_pos=pos)  # (1, 1, V)
    assert torch.equal(out, generate(model, ids, 10, eos_token_id=None))
    assert len(signatures) == 9  # one per one-token step


def test_static_kv_cache_writes_at_a_position_tensor_and_returns_every_slot():
    cache = StaticKVCache(n_layers=2, batch_size=1, max_len=6, n_kv_heads=2, head_dim=3)
    k, v = torch.randn(1, 2, 2, 3), torch.randn(1, 2, 2, 3)
    k_all, v_all = cache.update(1, torch.tensor(3), k, v)
    assert k_all.shape == v_all.shape == (1, 2, 6, 3)  # all max_len slots, whatever the position
    assert torch.equal(k_all[:, :, 3:5], k) and torch.equal(v_all[:, :, 3:5], v)
    assert not k_all[:, :, :3].any() and not k_all[:, :, 5:].any() and not cache.k[0].any()
    with pytest.raises(ValueError, match="written at a position tensor"):
        cache.update(0, 2, k, v)  # an int: attention would not mask the empty slots


def test_lesson_08_cache_takes_an_int_or_a_position_tensor():
    cache = KVCache(n_layers=1, batch_size=1, max_len=6, n_kv_heads=2, head_dim=3)
    k, v = torch.randn(1, 2, 2, 3), torch.randn(1, 2, 2, 3)
    k_int, _ = cache.update(0, 2, k, v)
    k_tensor, _ = cache.update(0, torch.tensor(2), k, v)
    assert k_int.shape == k_tensor.shape == (1, 2, 4, 3) and torch.equal(k_tensor[:, :, 2:], k)
    with pytest.raises(KVCacheFullError, match="holds 6 positions"):
        cache.update(0, torch.tensor(5), k, v)


def test_static_kv_cache_keeps_one_tensor_per_layer():
    """gpt-fast's layout: a compiled step writes each layer's cache in place only when it is a whole tensor of its
    own (a write into a slice of one shared tensor becomes copies after functionalization)."""
    cache = StaticKVCache(n_layers=3, batch_size=2, max_len=5, n_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
    tensors = cache.k + cache.v
    assert len(tensors) == 6 and all(t.shape == (2, 2, 5, 4) and t.dtype == torch.bfloat16 for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 6  # six allocations, no shared base
    assert cache.nbytes == 6 * 2 * 2 * 5 * 4 * 2 and cache.bytes_per_token == cache.nbytes // 5
    like = StaticKVCache.like(KVCache(3, 2, 5, 2, 4, dtype=torch.bfloat16))
    assert like.nbytes == cache.nbytes and like.k[0].dtype == torch.bfloat16


def test_static_step_rejects_what_it_cannot_run(tiny_models):
    model = load(tiny_models["llama"][0])
    step, _ = counted_step(model, max_len=8, backend="eager")
    with pytest.raises(ValueError, match="one token per row"):
        step(prompt(100, T=2), torch.tensor(0))
    with pytest.raises(ValueError, match="outside the static cache's 8 slots"):
        step(prompt(100, T=1), torch.tensor(8))
    with pytest.raises(ValueError, match="takes no attention_mask"):
        step(prompt(100, T=1), torch.tensor(3), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="the decoder's cache holds batch 1 x 8"):
        step.generate(prompt(100, T=5), 4)
    with pytest.raises(ValueError, match="StaticDecodeStep takes no attention_mask"):  # before any forward pass
        step.generate(prompt(100, T=3), 2, attention_mask=torch.tensor([[0, 1, 1]]))


def test_teacher_forced_agreement_in_fp32_is_total(tiny_models):
    model = load(tiny_models["gpt2"][0])
    ids = generate(model, prompt(100, T=5), 10, eos_token_id=None)
    step, counter = counted_step(model, max_len=15)
    agreement, delta = teacher_forced_agreement(model, step, ids, prompt_len=5)
    assert agreement == 1.0 and delta < 1e-4 and counter.frame_count == 1


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="inductor's CPU code needs a C++ compiler")
def test_static_step_lowered_by_inductor_on_cpu_is_one_graph_with_eager_tokens(tiny_models):
    """What the CUDA path compiles, minus the CUDA graphs: inductor's generated code for Llama's static step, with the
    in-place index_copy_ into the cache. One graph for prompts of two lengths (the only inductor compile in CI)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = load(tiny_models["llama"][0])
    step = StaticDecodeStep(model, max_len=7 + 16, backend="inductor", mode=None)
    for T in (3, 7):
        ids = prompt(100, T=T, seed=2)
        assert torch.equal(step.generate(ids, 16, eos_token_id=None), generate(model, ids, 16, eos_token_id=None))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="inductor's CPU code needs a C++ compiler")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_default_cpu_step_streams_matvecs_in_one_graph_with_eager_tokens(tiny_models, name, monkeypatch):
    """The CPU default: compiled_step's cpu backend (one-row matmuls as multiply-and-sum loops; GPT-2's carry a bias,
    Llama's not) on the matrices load laid out row by row for it (the compiled path is the default without
    HARDWAY_EAGER). One graph for prompts of two lengths, eager's tokens; the model is not changed by the step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    folder, _ = tiny_models[name]
    monkeypatch.delenv("HARDWAY_EAGER", raising=False)
    model = load(folder)
    monkeypatch.setenv("HARDWAY_EAGER", "1")
    eager_model = load(folder)
    assert model.laid_out_for == "compiled" and eager_model.laid_out_for == "eager"
    assert all(p.is_contiguous() for p in model.parameters())  # row by row, from load
    before = [(p.data_ptr(), p.stride()) for p in model.parameters()]
    step = StaticDecodeStep(model, max_len=7 + 12)  # CPU: compiled_step's cpu_step_backend(1)
    for T in (3, 7):
        ids = prompt(100, T=T, seed=3)
        assert torch.equal(step.generate(ids, 12, eos_token_id=None), generate(eager_model, ids, 12, eos_token_id=None))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert [(p.data_ptr(), p.stride()) for p in model.parameters()] == before  # the caller's model, untouched
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))


def test_hardway_generate_compiles_where_it_pays_and_keeps_the_step(tiny_models, monkeypatch):
    """hardway.generate on CPU fp32 without HARDWAY_EAGER: lesson 12's step (a counting backend stands in for
    inductor), the tokens of eager generate, the same step for the next call of the model; eager=True, a padded
    batch or HARDWAY_EAGER=1: no step."""
    import hardway
    from hardway.decode import static
    from hardway.kernels import compile as compile_kernels

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    monkeypatch.setattr(compile_kernels, "cpu_step_backend", lambda rows=1: counter)
    model = load(tiny_models["llama"][0])
    ids = prompt(100, T=5, seed=4)
    expected = generate(model, ids, 10, eos_token_id=None)
    monkeypatch.setenv("HARDWAY_EAGER", "1")
    assert torch.equal(hardway.generate(model, ids, max_new_tokens=10, eos_token_id=None), expected)
    assert counter.frame_count == 0 and model not in static._SHARED_STEPS
    monkeypatch.delenv("HARDWAY_EAGER")
    assert torch.equal(hardway.generate(model, ids, max_new_tokens=10, eos_token_id=None, eager=True), expected)
    assert counter.frame_count == 0
    assert torch.equal(hardway.generate(model, ids, max_new_tokens=10, eos_token_id=None), expected)
    step = static._SHARED_STEPS[model]
    assert counter.frame_count == 1 and step.model is None and step.kv_cache.max_len == min(256, model.max_seq_len)
    assert torch.equal(hardway.generate(model, ids[:, :3], max_new_tokens=12, eos_token_id=None),
                       generate(model, ids[:, :3], 12, eos_token_id=None))
    assert static._SHARED_STEPS[model] is step and counter.frame_count == 1  # reused: no new graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graphs decode step needs CUDA")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_static_cuda_graph_step_gives_eager_tokens_fp32(tiny_models, name):
    torch._dynamo.reset()
    folder, _ = tiny_models[name]
    model = load(folder, device="cuda", dtype=torch.float32)
    step = StaticDecodeStep(model, max_len=9 + 32)  # inductor, mode="reduce-overhead"
    for T in (5, 9, 5):  # compile + warm-up, record, replay; another prompt length, the same graph
        ids = prompt(100, T=T, seed=2).cuda()
        assert torch.equal(step.generate(ids, 32, eos_token_id=None), generate(model, ids, 32, eos_token_id=None))


def test_roofline_arithmetic(tiny_models):
    model = load(tiny_models["llama"][0])
    n_params = sum(p.numel() for p in model.parameters())  # the tied head is one Parameter
    assert weight_bytes(model) == 4 * n_params
    assert n_params == 120 * 64 + 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64) + 64
    assert roofline_tokens_per_s(2e9, 20e9) == 10.0
    assert measure_bandwidth("cpu", mib=8, reps=2) > 1e8  # any machine copies faster than 100 MB/s
    assert measure_read_bandwidth("cpu", mib=8, reps=2) > 1e8


def test_time_interleaved_warms_up_then_times_each_call():
    calls = []
    times, outs = time_interleaved({"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, "cpu", reps=3)
    assert calls == ["a", "b"] * 4 and outs == {"a": 1, "b": 2}  # one warm-up round, then 3 interleaved rounds
    assert len(times["a"]) == len(times["b"]) == 3 and all(t >= 0 for t in times["a"])


def test_llama_1b_standin_config_has_llama_3_2_1bs_parameter_count():
    """tools/standins.py --llama-1b (lesson 12's GPU target without the hub) must be Llama-3.2-1B's architecture: its
    config builds Llama-3.2-1B's 1,235,814,400 parameters (lesson 12's count), in transformers and in hardway alike."""
    import standins  # tools/, on sys.path through conftest.py
    from transformers import LlamaConfig, LlamaForCausalLM

    from hardway.models.llama import Llama, ModelConfig

    cfg = standins.LLAMA_1B_CONFIG
    with torch.device("meta"):
        theirs = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}))
        ours = Llama(ModelConfig.from_dict(cfg))
    assert theirs.num_parameters() == 1_235_814_400
    assert sum(p.numel() for p in ours.parameters()) == 1_235_814_400


def test_eos_read_every_few_steps_gives_the_same_tokens(tiny_models):
    """generate asks "has every row finished?" on the host only every `eos_check_every` steps (8 on CUDA: the question
    waits for the GPU) and cuts the steps that ran after; the output must not depend on how often it asks."""
    folder, reference = tiny_models["gpt2"]
    model = load(folder)
    ids = prompt(100, B=2, T=5, seed=5)
    free_running = generate(model, ids, 30, eos_token_id=None)  # (2, 35)
    for eos in ([int(free_running[0, 8]), int(free_running[1, 16])],  # both rows stop, at different steps
                [int(free_running[0, 8])]):  # maybe only one row stops
        expected = generate(model, ids, 30, eos_token_id=eos, eos_check_every=1)  # ask at every step
        with torch.inference_mode():
            theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                                        eos_token_id=eos, pad_token_id=eos[0])
        assert torch.equal(expected, theirs)
        for every in (2, 3, 8, 64):
            assert torch.equal(generate(model, ids, 30, eos_token_id=eos, eos_check_every=every), expected), (eos, every)
    assert generate(model, ids, 30, eos_token_id=[int(free_running[0, 8]), int(free_running[1, 16])]).shape[1] < 35
