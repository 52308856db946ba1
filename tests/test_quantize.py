"""hardway.quantize: int8 / int4 weight-only quantization, its layer's three ways of multiplying, the GGUF's own
blocks kept bit for bit, and whole models (Llama from the real GGUF, GPT-2) through the CausalLM contract."""

import copy

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hardway
from hardway.kernels.c_loops import c_loops_available, c_loops_quantize_activations, group_c_loops, is_c_loop
from hardway.decode.static import StaticDecodeStep
from hardway.formats.gguf import read_gguf, smollm2_gguf
from hardway.formats.hub import checkpoint
from hardway.models.llama import Llama, ModelConfig
from hardway.kernels.quantized import (QuantizationError, QuantizedLinear, dequantize_int4, dequantize_int8, gguf_blocks, matvec_int4, pack_nibbles, quantize_activations, quantize_int4, quantize_int8, quantize_linears, round_activations, unpack_nibbles, weights_nbytes)
from hardway.loading import gguf_quantized


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return smollm2_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def dense(real):
    """The real file loaded once for the module (a load dequantizes every matrix); tests that change it copy it."""
    return hardway.load(real)


def test_int8_rounds_each_weight_to_the_nearest_level_of_its_row():
    w = torch.randn(16, 96) * torch.logspace(-3, 1, 16)[:, None]  # rows of very different sizes
    w[3] = 0  # a row of zeros: scale 0, no division by it
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (16, 1) and q.abs().max() <= 127
    assert torch.equal(q[3], torch.zeros(96, dtype=torch.int8))
    err = (dequantize_int8(q, scales) - w).abs()  # (16, 96)
    assert (err <= scales.float() / 2 * (1 + 1e-3)).all()  # half a step of its own row, fp16's rounding aside
    assert (q.abs().amax(dim=1)[w.abs().amax(dim=1) > 0] >= 126).all()  # each row's largest weight near +-127


def test_int4_groups_keep_their_minimum_and_range():
    w = torch.randn(8, 128)
    w[2, 32:64] = 0.5  # a constant group: scale 0, every weight its minimum
    packed, scales, mins = quantize_int4(w, 32)
    assert packed.shape == (8, 64) and scales.shape == mins.shape == (8, 4)
    assert scales[2, 1] == 0 and torch.equal(dequantize_int4(packed, scales, mins)[2, 32:64], w[2, 32:64])
    err = (dequantize_int4(packed, scales, mins) - w).abs()
    step = scales.float().repeat_interleave(32, dim=1)  # (8, 128)
    assert (err <= step / 2 + 2e-3 * w.abs().max()).all()  # half a step, plus fp16 rounding of m and d
    q = unpack_nibbles(packed)
    assert q.max() == 15 and q.min() == 0


@pytest.mark.parametrize("group", [32, 64, 6])
def test_nibbles_are_in_ggufs_order_a_groups_first_half_low_second_half_high(group):
    q = torch.randint(0, 16, (3, 2 * group))
    packed = pack_nibbles(q, group)  # (3, group)
    assert torch.equal(unpack_nibbles(packed, group), q.to(torch.uint8))
    half = group // 2
    for g in range(2):
        byte = packed[:, g * half:(g + 1) * half]  # (3, half): group g's bytes
        assert torch.equal(byte & 0x0F, q[:, g * group:g * group + half].to(torch.uint8))
        assert torch.equal(byte >> 4, q[:, g * group + half:(g + 1) * group].to(torch.uint8))


@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, 32), (4, 64)])
def test_the_layer_multiplies_as_its_dequantized_weight(bits, group):
    torch.manual_seed(0)
    linear = nn.Linear(192, 320)
    layer = QuantizedLinear.from_linear(linear, bits, group)
    w = layer.dequantized_weight()  # (320, 192)
    x, prompt = torch.randn(1, 1, 192), torch.randn(2, 5, 192)
    with torch.no_grad():
        reference = F.linear(x, w, linear.bias)
        assert (layer(x) - reference).abs().max() < 1e-5 * reference.abs().max()  # the one-row form
        assert torch.equal(layer(prompt), F.linear(prompt, w, linear.bias))  # many rows: dequantize, then matmul
        if group is None or bits == 4:
            kernel = QuantizedLinear.from_linear(linear, bits, group).use_kernel()
            assert (kernel(x) - reference).abs().max() < 1e-5 * reference.abs().max()
            assert (kernel(prompt) - F.linear(prompt, w, linear.bias)).abs().max() < 1e-4
    # the bytes: integers plus 2-byte scales (and minimums)
    groups = 192 // (group or 192)
    assert layer.nbytes == 320 * 192 * bits // 8 + 320 * groups * 2 * (2 if bits == 4 else 1)


def test_the_int4_one_row_form_is_d_times_dot_plus_m_times_sum():
    packed, scales, mins = quantize_int4(torch.randn(4, 64), 32)
    x = torch.randn(64)
    q = unpack_nibbles(packed, 32).float()  # (4, 64)
    expected = sum(scales[:, g].float() * (q[:, 32 * g:32 * g + 32] @ x[32 * g:32 * g + 32])
                   + mins[:, g].float() * x[32 * g:32 * g + 32].sum() for g in range(2))
    assert torch.allclose(matvec_int4(x, packed, scales, mins), expected, atol=1e-5)


@pytest.mark.parametrize("bits, group", [(4, 128), (4, 9), (8, 100), (8, 0)])
def test_a_group_that_does_not_split_the_row_is_refused(bits, group):
    with pytest.raises(QuantizationError, match="group size"):
        QuantizedLinear.from_linear(nn.Linear(576, 8), bits, group)


def test_use_kernel_needs_one_int8_scale_per_row():
    with pytest.raises(QuantizationError, match="one scale a row"):
        QuantizedLinear.from_linear(nn.Linear(64, 8), 8, 32).use_kernel()


def test_the_files_blocks_become_layers_bit_for_bit(real):
    file, reader = read_gguf(real), gguf.GGUFReader(real)
    for name in ("blk.3.ffn_down.weight", "token_embd.weight"):
        info, t = file.tensors[name], next(t for t in reader.tensors if t.name == name)
        tensors = gguf_blocks(file.raw(name), info.type_name, info.shape)
        mine = dequantize_int4(*tensors) if info.type_name == "Q4_1" else dequantize_int8(*tensors)
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).copy())
        assert torch.equal(mine.view(torch.int32), expected.reshape(mine.shape).view(torch.int32)), name


def test_gguf_quantized_is_the_dequantized_model(real, dense):
    kept = gguf_quantized(real)
    layers = [m for m in kept.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 30 * 7 + 1 and sum(layer.bits == 8 for layer in layers) == 1  # 210 Q4_1 + the head's Q8_0
    ids = torch.randint(0, 49152, (1, 9), generator=torch.Generator().manual_seed(0))
    # fp32 sums in another order through 30 layers: a few ulps of the logits' size (about 25 here)
    tolerance = 1e-5 * 25
    with torch.inference_mode():
        a, b = kept(ids), dense(ids)  # a prompt: the same weights; hardway.load re-stores dense's column by column,
        assert (a - b).abs().max() < tolerance and torch.equal(a.argmax(-1), b.argmax(-1))  # so MKL sums differently
        cache_k, cache_d = kept.new_kv_cache(1, 10), dense.new_kv_cache(1, 10)
        kept(ids, kv_cache=cache_k), dense(ids, kv_cache=cache_d)
        a = kept(ids[:, -1:], kv_cache=cache_k, start_pos=9)  # one row: the product from the integers
        b = dense(ids[:, -1:], kv_cache=cache_d, start_pos=9)
    assert (a - b).abs().max() < tolerance and torch.equal(a.argmax(-1), b.argmax(-1))
    stored, read = weights_nbytes(kept)
    # 134.5 M weights: the embedding table stays fp32 (stored, not read); the head's Q8_0 34 bytes a block of 32,
    # the 210 matrices' Q4_1 20 bytes a block; the 61 norm vectors fp32
    n_embd = 49152 * 576
    n_q4 = sum(i.n_elements for i in read_gguf(real).tensors.values() if i.type_name == "Q4_1")
    norms = sum(i.n_elements for i in read_gguf(real).tensors.values() if i.type_name == "F32") * 4
    assert read == n_embd // 32 * 34 + n_q4 // 32 * 20 + norms and stored == read + 4 * n_embd


def test_quantize_linears_on_llama_and_gpt2(dense):
    llama = quantize_linears(copy.deepcopy(dense), 4, 64)
    assert sum(isinstance(m, QuantizedLinear) for m in llama.modules()) == 30 * 7 + 1  # the tied head too
    assert not any(isinstance(m, nn.Linear) for m in llama.modules())
    gpt2 = hardway.load(checkpoint("openai-community/gpt2"))
    ids = torch.randint(0, 50257, (1, 8))
    with torch.inference_mode():
        before = gpt2(ids)
        quantize_linears(gpt2, 8)
        after = gpt2(ids)
    assert sum(isinstance(m, QuantizedLinear) for m in gpt2.modules()) == 4 * 12
    assert (after - before).abs().max() < 0.05 * before.abs().max()
    tokens = hardway.generate(gpt2, ids, max_new_tokens=4, eos_token_id=None)
    assert tokens.shape == (1, 12)


@pytest.mark.parametrize("bits, group", [(8, None), (4, 32)])
def test_a_matrix_stored_column_by_column_quantizes_to_contiguous_integers(bits, group):
    linear = nn.Linear(64, 96)
    linear.weight.data = linear.weight.data.T.contiguous().T  # hardway.load's decode layout for wide matrices
    layer = QuantizedLinear.from_linear(linear, bits, group)
    assert layer.q.is_contiguous() and layer.scales.is_contiguous()
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        assert torch.allclose(layer.use_kernel()(x), F.linear(x, layer.dequantized_weight(), linear.bias), atol=1e-4)


def test_int8_per_row_agrees_with_torchaos_int8_weight_only(real):
    """torchao's Int8WeightOnlyConfig (one scale a row, symmetric) as the reference for our int8 numerics. Its scale
    is max |w| / 127.5 over the levels -128..127 and ours max |w| / 127 over -127..127, so the two differ by that
    ratio, the integers by at most one level, and the products by as little as the rounding of each. torchao is not a
    dependency: once installed, transformers imports it whenever it loads a model, and its import writes warnings to
    stderr, which every one-line error of the CLI would then carry. `uv pip install torchao==0.18.0` runs this test."""
    pytest.importorskip("torchao", reason="torchao is not installed (see the docstring)")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from hardway.formats.gguf import dequantize

    w = dequantize(read_gguf(real), "blk.3.ffn_down.weight").reshape(576, 1536)  # (out, in): a real matrix
    linear = nn.Linear(1536, 576, bias=False)
    linear.weight.data = w.clone()
    ours = QuantizedLinear.from_linear(linear, 8)
    theirs = nn.Sequential(nn.Linear(1536, 576, bias=False))
    theirs[0].weight.data = w.clone()
    quantize_(theirs, Int8WeightOnlyConfig())
    t = theirs[0].weight  # torchao's Int8Tensor: qdata (out, in) int8, scale (out, 1)
    ratio = ours.scales.float()[:, 0] / t.scale.float().reshape(-1)  # (out,)
    assert torch.allclose(ratio, torch.full_like(ratio, 127.5 / 127), rtol=1e-3)  # fp16's rounding of our scale
    assert (ours.q.int() - t.qdata.int()).abs().max() <= 1
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = x @ w.T  # (4, 576)
        err_ours = (ours(x) - exact).norm() / exact.norm()
        err_theirs = (theirs(x) - exact).norm() / exact.norm()
        assert (ours(x[:1]) - theirs(x[:1])).abs().max() < 0.02 * exact.abs().max()  # the one-row form too
    assert err_ours < 0.01 and 0.8 < err_ours / err_theirs < 1.25, (err_ours, err_theirs)


needs_c = pytest.mark.skipif(not c_loops_available(), reason="no C compiler with OpenMP and _Float16 here")


@needs_c  # the last two groups are ones the AVX-512 code does not take: the plain C loops run
@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, 32), (4, 64), (8, 16), (4, 6)])
def test_the_c_loop_multiplies_as_the_dequantized_weight(bits, group):
    """By default the row stays in fp32 (on a CPU with VNNI too): the products of the dequantized weight, summed in
    another order."""
    torch.manual_seed(0)
    linear = nn.Linear(192, 320)
    layer = QuantizedLinear.from_linear(linear, bits, group).use_c_loop()
    x, prompt = torch.randn(1, 1, 192), torch.randn(2, 5, 192)
    w = layer.dequantized_weight()  # (320, 192)
    with torch.no_grad():
        reference = F.linear(x, w, linear.bias)
        assert (layer(x) - reference).abs().max() < 1e-5 * reference.abs().max()  # fp32 sums in another order
        assert not torch.equal(layer(x), F.linear(x, torch.zeros_like(w), linear.bias))  # it did multiply
        assert torch.equal(layer(prompt), F.linear(prompt, w, linear.bias))  # many rows: dequantize, then matmul


def test_activations_round_to_q8_0s_levels():
    """quantize_activations against the gguf package's Q8_0 on the same row: Q8_0 stores the scale in fp16 and rounds
    halves away from zero, we keep the fp32 scale and round halves to even, so the scales agree to fp16's rounding
    and the integers by at most one level."""
    x = torch.randn(4, 96) * torch.logspace(-2, 1, 4)[:, None]  # (4, 96): rows of very different sizes
    x[1, 32:64] = 0  # a block of zeros: scale 0, xq 0
    xq, scales = quantize_activations(x)  # (4, 96) int8, (4, 3)
    blocks = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(4, 3, 34)  # fp16 d, 32 int8
    their_scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16).astype(np.float32))[..., 0]  # (4, 3)
    their_q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(4, 96)
    assert torch.allclose(scales, their_scales, rtol=1e-3, atol=0) and xq.abs().max() == 127
    assert (xq.int() - their_q.int()).abs().max() <= 1 and torch.equal(xq[1, 32:64], torch.zeros(32, dtype=torch.int8))
    err = (round_activations(x) - x).abs()  # half a step of its own block
    assert (err <= scales.repeat_interleave(32, dim=1) / 2 * (1 + 1e-6)).all()


needs_vnni = pytest.mark.skipif(not c_loops_quantize_activations(), reason="the C loops here keep the row in fp32 "
                                                                          "(no AVX512-VNNI, or no compiler)")


@needs_vnni  # shapes with an odd number of blocks of 32 (160) and of groups of 4 (576 / 32 = 18): the masked ends
@pytest.mark.parametrize("bits, group, shape", [(8, None, (320, 192)), (8, 32, (100, 160)), (8, 64, (320, 192)),
                                                (4, 32, (64, 576))])
def test_the_integer_c_loop_multiplies_by_the_rounded_row(bits, group, shape):
    """With VNNI the C loop computes the dequantized weight times the row rounded to int8 in blocks of 32 (int4's
    minimum term times the exact sum of x), to fp32 rounding. So its distance from the fp32 row's product is bounded
    by the rounding itself: per output, the sum over columns of |w| times half a step of that column's block."""
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(shape[1], shape[0], bias=False), bits, group)
    layer.use_c_loop(quantize_activations=True)
    x = torch.randn(1, 1, shape[1]) * 3
    if bits == 8:
        w, w_min = layer.dequantized_weight().double(), torch.zeros(shape, dtype=torch.float64)  # (out, in)
    else:  # w = d q + m: the q part meets the rounded row, the m part the exact one
        w_min = layer.mins.double().repeat_interleave(group, dim=1)  # (out, in)
        w = layer.dequantized_weight().double() - w_min
    _, scales = quantize_activations(x[0, 0])  # (in / 32,)
    with torch.no_grad():
        y = layer(x)[0, 0].double()  # (out,)
    rounded = w @ round_activations(x[0, 0]).double() + w_min @ x[0, 0].double()
    exact = (w + w_min) @ x[0, 0].double()
    assert (y - rounded).abs().max() < 1e-6 * rounded.abs().max()  # the same numbers, fp32 sums in another order
    bound = w.abs() @ (scales.double().repeat_interleave(32) / 2)  # (out,)
    assert ((y - exact).abs() <= bound * (1 + 1e-5) + 1e-6 * exact.abs().max()).all()
    assert not torch.allclose(y, exact, rtol=1e-6, atol=0)  # it did round the row
    assert torch.equal(layer(x), layer(x))  # and the same row gives the same answer


@needs_c
def test_the_c_loop_runs_inside_a_compiled_function():
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(64, 96, bias=False), 4, 32).use_c_loop()
    x = torch.randn(1, 1, 64)
    compiled = torch.compile(lambda x: layer(x * 2) + 1, fullgraph=True)  # fullgraph: the op must not break it
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x * 2) + 1)  # the same C loop on the same row, compiled or not
        assert not torch.equal(compiled(x), torch.ones(1, 1, 96))  # which did multiply


def c_calls(gm) -> int:
    return sum(map(is_c_loop, gm.graph.nodes))


@needs_c
@pytest.mark.parametrize("bits", [8, 4])
def test_group_c_loops_merges_only_the_calls_that_share_a_row(bits):
    """Three layers on one row and a fourth on another: the three become one call, the fourth stays; and a layer that
    rounds its row to int8 is not merged with one that keeps it in fp32. The answers are the same numbers."""
    torch.manual_seed(0)
    a, b, c, d, rounding = [QuantizedLinear.from_linear(nn.Linear(64, n, bias=False), bits, 32)
                            for n in (64, 32, 32, 96, 32)]
    for layer in (a, b, c, d):
        layer.use_c_loop()
    rounding.use_c_loop(quantize_activations=True)

    def f(x):  # x (1, 1, 64)
        x = x * 2
        return torch.cat([a(x), b(x), c(x) + 1, d(x + 1), rounding(x)], -1)  # (1, 1, 288)

    counts = []

    def grouping(gm, example_inputs):  # the pass, then the graph run as traced (no compiler in between)
        counts.append(c_calls(gm))
        counts.append(group_c_loops(gm))
        counts.append(c_calls(gm))
        return gm.forward

    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        assert torch.equal(torch.compile(f, backend=grouping, fullgraph=True)(x), f(x))
    assert counts == [5, 2, 3]


@needs_c
@pytest.mark.parametrize("bits", [8, 4])
def test_a_grouped_decode_step_makes_four_c_calls_a_block_and_the_same_logits(bits):
    """A 2-layer Llama's compiled decode step: 7 C-loop calls a block and the head (15) become 4 a block and the head
    (9): q, k, v one call, gate and up another. Each row of a merged answer is the same loop on the same row, so
    the logits are those of the ungrouped step, exactly."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = quantize_linears(Llama(config).eval(), bits, 32)
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear):
            layer.use_c_loop()
    counts = []

    def grouping(gm, example_inputs):
        counts.append(c_calls(gm))
        group_c_loops(gm)
        counts.append(c_calls(gm))
        return gm.forward

    ids = torch.randint(0, 120, (1, 5))
    grouped, plain = StaticDecodeStep(model, 12, backend=grouping), StaticDecodeStep(model, 12, backend="eager")
    with torch.inference_mode():
        tokens = grouped.generate(ids, 4, eos_token_id=None)  # (1, 9)
        assert torch.equal(tokens, plain.generate(ids, 4, eos_token_id=None))
        last, pos = tokens[:, -1:], torch.tensor(tokens.shape[1] - 1)
        assert torch.equal(grouped(last, pos), plain(last, pos))  # (1, 1, 120): every logit
    assert counts == [15, 9]


def test_use_c_loop_without_a_compiler_says_so(monkeypatch):
    from hardway.kernels import c_loops
    monkeypatch.setattr(c_loops, "c_library", lambda: None)  # what a machine without a compiler gets
    with pytest.raises(QuantizationError, match="no C compiler"):
        QuantizedLinear.from_linear(nn.Linear(64, 8), 8).use_c_loop()


@needs_c
def test_compile_c_builds_once_and_keeps_what_it_built(monkeypatch, tmp_path):
    """A fresh cache: the first call builds, the second finds the same file untouched; another source is another
    file; nothing half-written is left beside them; a failed build raises with the compiler's messages."""
    import subprocess

    from hardway.kernels import c_loops
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = "int answer(void) { return 42; }\n"
    lib = c_loops.compile_c(source, "answer")
    assert lib.parent == tmp_path / "hardway" and lib.name.startswith("answer-")
    built = lib.stat().st_mtime_ns
    assert c_loops.compile_c(source, "answer") == lib and lib.stat().st_mtime_ns == built  # found, not rebuilt
    assert c_loops.compile_c(source.replace("42", "43"), "answer") != lib  # the source is in the key
    assert sorted(p.suffix for p in lib.parent.iterdir()) == [".so", ".so"]  # no temporary folder left
    with pytest.raises(subprocess.CalledProcessError) as failed:
        c_loops.compile_c("int broken(void) { return }\n", "broken")
    assert "error" in failed.value.stderr
    assert sorted(p.suffix for p in lib.parent.iterdir()) == [".so", ".so"]  # the failed build left nothing either
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    assert c_loops.compile_c(source, "answer") is None
