"""Qwen3.5's GGUF on its blocks (lessons 26 and 28): `load_gguf_blocks` keeps the matrices of a `qwen35` file in the
file's blocks and moves them back to the hub's order as whole rows (the value heads of in_proj_qkv's v part,
in_proj_z, in_proj_b, in_proj_a) or whole blocks of each row (out_proj's columns), or, where a block would hold parts
of two value heads, reads that one matrix in fp32.

The reference is lesson 16's exact reading of the same file (`hardway.load`), which test_qwen35_gguf holds to the
checkpoint and to transformers. Three files from the same tiny checkpoint: q8_0 with d_v = 32 (one block a value
head: out_proj on its blocks), q8_0 with d_v = 16 (two heads a block: out_proj read in fp32), and Q4_K with d_v = 64
(four heads a super-block of 256: out_proj in fp32). The gguf package cannot quantize to Q4_K, so `quantize_q4_k`
does, held to the gguf package's own Q4_K dequantizer.

The checkpoint's head is made to predict one token after each (`successor_head`): a model with random weights
spreads its next-token logits so evenly that the top two are within 1e-3 of each other at most steps, closer than
the blocks' rounding moves them (~5e-3), and greedy decoding on two paths would part at the first near-tie. With a
clear winner at every step (at Q8_0 a margin of 8.4 at least, against a difference of 0.13 at most) greedy tokens
must be the same."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import hardway
import hardway.kernels.gguf_layers as gguf_layers
from hardway import cli
from hardway.decode.generate import generate
from hardway.formats.gguf import dequantize, read_gguf
from hardway.kernels.gguf_layers import GGUFLinear, StackedProjections, qwen35_block_moves, takes_blocks
from hardway.loading import load_gguf_blocks, open_model
from test_qwen35_gguf import IDS, tiny_checkpoint, write_qwen35_gguf

TOKENS = 16  # greedy tokens generated on both paths


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """(rows, cols) fp32 -> (rows, bytes a row) uint8 in ggml's Q4_K layout: super-blocks of 256 weights, each fp16 d
    and dmin, eight sub-blocks of 32 with a 6-bit scale and min, 4-bit weights, w = d * sc * q - dmin * m. A plain
    quantizer (min and max of each sub-block), not llama.cpp's search for the best scales: the layout is the point."""
    rows = w.shape[0]
    x = torch.from_numpy(w.astype(np.float32)).reshape(-1, 8, 32)  # (super-blocks, sub-blocks, 32)
    low = x.amin(-1).clamp(max=0)  # (n, 8): a sub-block's min, at most 0 (m is stored as a non-negative number)
    scale, mins = (x.amax(-1) - low) / 15, -low  # (n, 8) each
    d, dmin = (scale.amax(-1) / 63).half(), (mins.amax(-1) / 63).half()  # (n,) each
    df, dminf = d.float()[:, None], dmin.float()[:, None]  # (n, 1)
    sc = (scale / df.clamp(min=1e-30)).round().clamp(0, 63).to(torch.uint8)  # (n, 8)
    m = (mins / dminf.clamp(min=1e-30)).round().clamp(0, 63).to(torch.uint8)  # (n, 8)
    step = (df * sc.float())[..., None]  # (n, 8, 1)
    q = ((x + (dminf * m.float())[..., None]) / step.clamp(min=1e-30)).round().clamp(0, 15).to(torch.uint8)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # (n, 128): sub-blocks 2c and 2c + 1 share 32 bytes
    scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], dim=1)  # (n, 12): ggml's 6-bit packing
    raw = torch.cat([d.view(torch.uint8).reshape(-1, 2), dmin.view(torch.uint8).reshape(-1, 2), scales, qs], dim=1)
    return raw.reshape(rows, -1).numpy()  # (rows, 144 bytes a super-block)


def test_the_q4_k_quantizer_writes_what_the_gguf_package_reads():
    w = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)).numpy() * 0.05  # (6, 512)
    back = gguf.quants.dequantize(quantize_q4_k(w), gguf.GGMLQuantizationType.Q4_K)  # (6, 512)
    step = (w.reshape(6, 2, 8, 32).max(-1) - np.minimum(w.reshape(6, 2, 8, 32).min(-1), 0)) / 15  # (6, 2, 8)
    # half a step, and the 6-bit scales' and fp16's rounding on top: well under one step
    assert (np.abs(back - w).reshape(6, 2, 8, 32) <= step[..., None]).all()
    assert np.abs(back - w).max() > 0  # it did round


def write_q4_k(f32_path: Path, path: Path) -> Path:
    """A copy of an f32 qwen35 file with every matrix but the convolution's in Q4_K: what the converter would write
    (it quantizes after it reorders, so the file's order is quantized, as here)."""
    source = read_gguf(f32_path)
    writer = gguf.GGUFWriter(path, arch="qwen35")
    for key, value in source.metadata.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = source.value_types[key]
        writer.add_key_value(key, value, gguf.GGUFValueType[kind.split("[")[0]],
                             sub_type=gguf.GGUFValueType[kind[6:-1]] if kind.startswith("ARRAY") else None)
    for name, info in source.tensors.items():
        w = dequantize(source, name).numpy()
        if w.ndim == 2 and not name.endswith("ssm_conv1d.weight"):
            writer.add_tensor(name, quantize_q4_k(w), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def successor_head(folder: Path, seed: int = 0) -> Path:
    """The checkpoint in `folder` with a random token table and a head whose row for token π(v) is token v's
    embedding, π a random permutation: the residual stream keeps the current token's embedding, so the model
    predicts π(current token), with a margin of about |e|^2 - max e.e' (8 logits and more at Q8_0 here). The layers
    are unchanged."""
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=generator)  # (V, C)
    successor = torch.randperm(table.shape[0], generator=generator)  # (V,): π
    head = torch.empty_like(table)
    head[successor] = table  # head[π(v)] = e_v
    tensors.update({"model.embed_tokens.weight": table, "lm_head.weight": head})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


FILES = {  # name -> (quantization, tiny_checkpoint's sizes, whether out_proj's value heads are whole blocks)
    "q8_0": ("q8_0", {}, True),
    "q8_0-dv16": ("q8_0", {"linear_value_head_dim": 16}, False),
    "q4_k": ("q4_k", {"hidden_size": 256, "intermediate_size": 512, "head_dim": 128, "linear_value_head_dim": 64},
             False),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35-blocks")
    paths = {}
    for name, (quantization, sizes, _) in FILES.items():
        folder = successor_head(tiny_checkpoint(root / name, **sizes))
        f32 = write_qwen35_gguf(folder, root / f"{name}-f32.gguf", mtp=False)
        paths[name] = (write_qwen35_gguf(folder, root / f"{name}.gguf", "q8_0", mtp=False) if quantization == "q8_0"
                       else write_q4_k(f32, root / f"{name}.gguf"))
    return paths


def linears(model: nn.Module) -> dict:
    """{name: module} of every projection, on blocks or in fp32 (the layers named *_proj*, and the head)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, GGUFLinear))
            and ("_proj" in name.rsplit(".", 1)[-1] or name == "lm_head")}


@pytest.mark.parametrize("name", FILES)
def test_every_matrix_stays_in_its_blocks_but_an_out_proj_that_cannot(files, name):
    path, (_, _, whole) = files[name], FILES[name]
    model = load_gguf_blocks(path)
    assert takes_blocks(path)
    in_fp32 = sorted(n for n, m in linears(model).items() if isinstance(m, nn.Linear))
    out_projs = [f"blocks.{i}.delta_net.out_proj" for i in (0, 2)]
    assert in_fp32 == ([] if whole else out_projs), in_fp32
    file = read_gguf(path)
    assert model.blocks[0].delta_net.in_proj_qkv.type_name == file.tensors["blk.0.attn_qkv.weight"].type_name
    assert isinstance(model.blocks[0].mlp.gate_up_proj, StackedProjections)  # lesson 26's stacked gate and up
    assert [n for n, p in model.named_parameters() if p.dim() >= 2 and "out_proj" not in n] == [
        "blocks.0.delta_net.conv1d.weight", "blocks.2.delta_net.conv1d.weight"]  # kept in f32 in the file too


@pytest.mark.parametrize("name", FILES)
def test_the_blocks_are_the_exact_weights_in_the_hubs_order(files, name):
    """Each matrix's blocks, dequantized, are bit for bit the weight lesson 16's exact path reads from the same file
    (which undoes the reordering on fp32 numbers): the moves put every row and block where the hub has it. Without
    them the value heads' rows and columns would be the converter's."""
    exact = dict(hardway.load(files[name]).named_parameters())
    checked = 0
    for layer, module in linears(load_gguf_blocks(files[name])).items():
        if isinstance(module, GGUFLinear):
            assert torch.equal(module.dequantized_weight(), exact[layer + ".weight"]), layer
            checked += 1
    assert checked == 2 * 5 + 2 * 4 + 4 * 3 + 1 - (0 if FILES[name][2] else 2)  # the head; not the embedding (a table)


def test_without_the_moves_the_value_heads_are_the_converters(files, monkeypatch):
    """The check above can fail: a loader that kept the file's order (no BLOCK_MOVES entry) has the tiled rows."""
    monkeypatch.setitem(gguf_layers.BLOCK_MOVES, "qwen35", lambda hub, type_name, config: (None, None))
    exact = dict(hardway.load(files["q8_0"]).named_parameters())
    model = load_gguf_blocks(files["q8_0"])
    for layer in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        w = getattr(model.blocks[0].delta_net, layer).dequantized_weight()
        assert not torch.equal(w, exact[f"blocks.0.delta_net.{layer}.weight"]), layer


def test_what_moves_and_what_cannot():
    """Real Qwen3.5 sizes (d_v = 128, 16 key heads, 32 value heads): Q8_0's blocks of 32 hold a quarter of a value
    head, so out_proj's columns move as blocks; a K-quant's 256 hold two heads, so it cannot."""
    config = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
              "linear_key_head_dim": 128}
    rows, blocks = qwen35_block_moves("model.layers.0.linear_attn.out_proj.weight", "Q8_0", config)
    assert rows is None and blocks.tolist()[:8] == [0, 1, 2, 3, 64, 65, 66, 67]  # k0's 2nd head: file's 17th
    assert qwen35_block_moves("model.layers.0.linear_attn.out_proj.weight", "Q4_K", config) is None
    rows, blocks = qwen35_block_moves("model.layers.0.linear_attn.in_proj_a.weight", "Q4_K", config)
    assert blocks is None and rows.tolist()[:4] == [0, 16, 1, 17]
    rows, _ = qwen35_block_moves("model.layers.0.linear_attn.in_proj_qkv.weight", "Q4_K", config)
    keys = 2 * 16 * 128
    assert rows[:keys].tolist() == list(range(keys)) and rows[keys + 128].item() == keys + 16 * 128  # q, k stay
    assert qwen35_block_moves("model.layers.3.mlp.down_proj.weight", "Q4_K", config) == (None, None)
    same = dict(config, linear_num_value_heads=16)
    assert qwen35_block_moves("model.layers.0.linear_attn.out_proj.weight", "Q4_K", same) == (None, None)
    one_key_head = dict(config, linear_num_key_heads=1)  # tiled and grouped are one order: nothing to undo
    assert qwen35_block_moves("model.layers.0.linear_attn.out_proj.weight", "Q4_K", one_key_head) == (None, None)


@pytest.mark.parametrize("name", FILES)
def test_the_logits_are_within_the_rounding_of_the_rows_and_greedy_agrees(files, name):
    """Against the exact path itself the blocks path differs by its rounding of each layer's input to int8 (half a
    step, max|x| / 127 over 32 numbers, at most). The yardstick is that rounding as noise: the exact path with every
    such input moved by uniform noise in [-step/2, step/2] of its own blocks, five draws; the blocks path may be off by
    no more than twice the largest. Greedy decoding (prefill, then a token at a time through the state) picks the
    same tokens: at every step the exact path's best token leads the next by more than twice the logits' difference,
    which the test checks too, so that a tie tipped by the rounding cannot be what it sees."""
    model, exact = load_gguf_blocks(files[name]), hardway.load(files[name])
    generator = torch.Generator().manual_seed(0)

    def noisy(m, args):
        x = args[0]  # (..., in)
        step = x.reshape(*x.shape[:-1], -1, 32).abs().amax(-1, keepdim=True) / 127  # (..., blocks, 1)
        u = torch.rand(step.shape[:-1] + (32,), generator=generator) - 0.5
        return (x + (u * step).reshape(x.shape),)

    with torch.inference_mode():
        reference = exact(IDS)
        delta = (model(IDS) - reference).abs().max().item()
        on_blocks = {n for n, m in linears(model).items() if isinstance(m, GGUFLinear)}
        hooks = [m.register_forward_pre_hook(noisy) for n, m in linears(exact).items() if n in on_blocks]
        noise = [(exact(IDS) - reference).abs().max().item() for _ in range(5)]
        for hook in hooks:
            hook.remove()
        assert 0 < delta <= 2 * max(noise), (delta, noise)
        ours = generate(model, IDS, max_new_tokens=TOKENS, do_sample=False, eos_token_id=None)
        theirs = generate(exact, IDS, max_new_tokens=TOKENS, do_sample=False, eos_token_id=None)
        assert torch.equal(ours, theirs)
        logits, logits_blocks = exact(theirs)[0, IDS.shape[1] - 1:-1], model(theirs)[0, IDS.shape[1] - 1:-1]
    top2 = logits.topk(2, dim=-1).values  # (TOKENS, 2)
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > 2 * (logits_blocks - logits).abs().max().item(), margin


def test_hardway_load_and_generate_run_it_on_its_blocks(files, capsys):
    """`hardway.load(blocks=True)` and the command line's default path for a .gguf: its blocks, said on stderr, and
    the blocks model's greedy tokens."""
    path = files["q8_0"]
    model = hardway.load(path, blocks=True)
    assert isinstance(model.blocks[0].delta_net.out_proj, GGUFLinear)
    assert cli.main(["generate", "--model", str(path), "--eager", "--max-new-tokens", "6", "the tin man"]) == 0
    tokenizer = open_model(path).tokenizer()
    prompt = tokenizer.encode("the tin man")
    expected = generate(model, torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
    out, err = capsys.readouterr()
    assert out == tokenizer.decode(expected.tolist()) + "\n", (out, err)
    assert f"{path.name} runs on its quantized blocks" in err, err
