"""Lesson 12's fast decode path: every speed-up must leave the tokens exactly as they were.

Speed itself is never tested here (benchmarks/decode.py measures it). What is tested: the head on the last position
only gives the full forward's last row; the column-by-column weight layout gives the row-by-row layout's tokens;
hardway.generate (preallocated, last_only prefill, no processors when greedy) gives the naive loop's tokens and
transformers'; the compiled decode step gives eager's tokens (traced on CPU with the "eager" backend; lowered by
inductor to CPU code as one graph for every position; with inductor and CUDA graphs when CUDA is present, skipped
otherwise). Matrices on 2 MB pages keep their values, and the roofline counts their bytes, not their maps'.
"""

import shutil

import pytest
import torch
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hardway.fast_decode import (HUGE_PAGE, CompiledDecodeStep, decode_layout, empty_on_huge_pages,
                                 measure_bandwidth, roofline_tokens_per_s)
from hardway.generation import generate
from hardway.loading import load
from hardway.memory import weight_bytes


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A seeded random 2-layer GPT-2 and Llama (GQA, tied head), saved by transformers; {name: (folder, reference)}."""
    out = {}
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(HFGPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=100)).eval()
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=True)).eval()
    for name, model in (("gpt2", gpt2), ("llama", llama)):
        with torch.no_grad():  # larger than the default init, so that the logits are far from uniform
            for p in model.parameters():
                p.normal_(0, 0.3) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(folder)
        out[name] = (folder, model)
    return out


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


def test_generate_prefills_once_with_last_only_and_reuses_a_given_cache(tiny_models):
    folder, _ = tiny_models["llama"]
    model = load(folder)
    calls = []

    class Spy(torch.nn.Module):  # the model interface, recording how generate calls it
        max_seq_len, eos_token_ids = model.max_seq_len, []

        def forward(self, input_ids, kv_cache=None, start_pos=0, last_only=False):
            calls.append((input_ids.shape[1], start_pos, last_only))
            return model(input_ids, kv_cache=kv_cache, start_pos=start_pos, last_only=last_only)

        def new_kv_cache(self, batch_size, max_len):
            raise AssertionError("a kv_cache was given: generate must not allocate another")

    ids = prompt(100, T=6)
    cache = model.new_kv_cache(1, 20)
    out = generate(Spy(), ids, 5, eos_token_id=None, kv_cache=cache)
    assert calls == [(6, 0, True)] + [(1, 6 + i, False) for i in range(4)]  # one prefill, then one token per step
    assert torch.equal(out, generate(model, ids, 5, eos_token_id=None))
    with pytest.raises(ValueError, match="kv_cache holds batch 1 x 20"):
        generate(model, ids, 15, kv_cache=cache)  # 6 + 15 > 20


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_step_traced_on_cpu_gives_eager_tokens(tiny_models, name):
    """torch.compile's graph capture (dynamo, fullgraph, dynamic shapes) with the eager backend: cheap enough for CI."""
    torch._dynamo.reset()
    folder, _ = tiny_models[name]
    model = load(folder)
    ids = prompt(100, T=5, seed=2)
    step = CompiledDecodeStep(model, max_len=5 + 24, backend="eager")
    eager = generate(model, ids, 24, eos_token_id=None)
    assert torch.equal(step.generate(ids, 24, eos_token_id=None), eager)
    assert torch.equal(step.generate(ids, 24, eos_token_id=None), eager)  # the cache is reused: still identical
    with pytest.raises(ValueError, match="one token at a time"):
        step(ids, step.kv_cache, 0)
    with pytest.raises(ValueError, match="its own kv_cache"):
        step(ids[:, :1], model.new_kv_cache(1, 8), 0)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="inductor's CPU code needs a C++ compiler")
def test_compiled_step_lowered_by_inductor_on_cpu_is_one_graph_with_eager_tokens(tiny_models):
    """What the CUDA path compiles, minus the CUDA graphs: inductor's generated code for Llama's one-token step, with the
    in-place writes into the static cache. One graph must serve every position (no recompile per length)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    folder, _ = tiny_models["llama"]
    model = load(folder)
    ids = prompt(100, T=5, seed=2)
    step = CompiledDecodeStep(model, max_len=5 + 24, backend="inductor", mode=None)
    eager = generate(model, ids, 24, eos_token_id=None)
    assert torch.equal(step.generate(ids, 24, eos_token_id=None), eager)
    assert torch.equal(step.generate(ids, 24, eos_token_id=None), eager)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graphs decode step needs CUDA")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_cuda_graph_step_gives_eager_tokens_fp32(tiny_models, name):
    torch._dynamo.reset()
    folder, _ = tiny_models[name]
    model = load(folder, device="cuda", dtype=torch.float32)
    ids = prompt(100, T=5, seed=2).cuda()
    step = CompiledDecodeStep(model, max_len=5 + 32)  # inductor, mode="reduce-overhead"
    eager = generate(model, ids, 32, eos_token_id=None)
    for _ in range(3):  # compile + warm-up, record, replay
        assert torch.equal(step.generate(ids, 32, eos_token_id=None), eager)


def test_roofline_arithmetic(tiny_models):
    model = load(tiny_models["llama"][0])
    n_params = sum(p.numel() for p in model.parameters())  # the tied head is one Parameter
    assert weight_bytes(model) == 4 * n_params
    assert n_params == 120 * 64 + 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64) + 64
    assert roofline_tokens_per_s(2e9, 20e9) == 10.0
    assert measure_bandwidth("cpu", mib=8, reps=2) > 1e8  # any machine copies faster than 100 MB/s


def test_llama_1b_standin_config_has_llama_3_2_1bs_parameter_count():
    """tools/standins.py --llama-1b (lesson 12's GPU target without the hub) must be Llama-3.2-1B's architecture: its
    config builds Llama-3.2-1B's 1,235,814,400 parameters (lesson 12's count), in transformers and in hardway alike."""
    import standins  # tools/, on sys.path through conftest.py
    from transformers import LlamaConfig, LlamaForCausalLM

    from hardway.llama import Llama, ModelConfig

    cfg = standins.LLAMA_1B_CONFIG
    with torch.device("meta"):
        theirs = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}))
        ours = Llama(ModelConfig.from_dict(cfg))
    assert theirs.num_parameters() == 1_235_814_400
    assert sum(p.numel() for p in ours.parameters()) == 1_235_814_400
