"""hardway.formats.mxfp4 against its two references: transformers' convert_moe_packed_tensors (openai's layout) and
the gguf package's MXFP4 (ggml's), bit for bit; our writer against the gguf package's quantizer; the blocks'
product against the dequantized matrix's; the damaged files refused in one line; and MXFP4 on lesson 26's kernel
(every path the same bits, off the exact product by the int8 rounding alone)."""

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import hardway.kernels.gguf_blocks as gguf_blocks
from hardway.errors import CheckpointError
from hardway.formats.mxfp4 import (GGML_MXFP4, dequantize_ggml, dequantize_openai, ggml_to_openai, mxfp4_matmul,
                                   openai_to_ggml, quantize_openai)
from test_gguf_blocks import ARM_TOOLS, runnable_paths

MXFP4 = GGMLQuantizationType.MXFP4


def random_blocks(shape, seed=0, low=100, high=140):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)  # every nibble, both signs of zero
    scales = torch.randint(low, high, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_openai_layout_equals_transformers_bit_for_bit(dtype):
    blocks, scales = random_blocks((3, 10, 4))  # (E, rows, G)
    blocks[0, 0, 0], scales[0, 0] = 0x8F, 0  # -0 and -6, the smallest scale
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, G · 32, rows)
    ours = dequantize_openai(blocks, scales, dtype=dtype).transpose(1, 2)
    assert ours.dtype == theirs.dtype and torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                                      theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_ggml_layout_equals_the_gguf_package_and_the_two_layouts_agree():
    blocks, scales = random_blocks((6, 5), low=0, high=255)  # every scale byte but NaN's, 0 included
    raw = openai_to_ggml(blocks, scales)  # (6, 5 · 17)
    theirs = gguf_dequantize(raw.numpy(), MXFP4)  # (6, 160)
    ours = dequantize_ggml(raw).reshape(6, -1)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))
    assert torch.equal(dequantize_openai(blocks[:, :3], scales[:, :3]), dequantize_ggml(raw[:, :51]).reshape(6, -1))
    back_blocks, back_scales = ggml_to_openai(raw)
    assert torch.equal(back_blocks, blocks) and torch.equal(back_scales, scales)


def test_our_writer_chooses_the_gguf_packages_codes():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 96, generator=g) * torch.logspace(-3, 2, 16)[:, None]  # scales over five decades
    w[0, :32] = 0  # a block of zeros
    w[1, :32] = torch.tensor([6.0, -4.0, 1.25] + [0.0] * 29)  # a tie: 1.25 is as near 1 as 1.5
    blocks, scales = quantize_openai(w)
    theirs = gguf_quantize(w.numpy(), MXFP4)  # (16, 3 · 17)
    assert np.array_equal(openai_to_ggml(blocks, scales).numpy(), theirs)
    error = (dequantize_openai(blocks, scales) - w).abs().max(dim=-1).values / w.abs().max(dim=-1).values
    assert error.max() <= 0.25  # a half step of E2M1 at its coarsest (between 4 and 6: 1 in 6, a sixth of max)


def test_the_blocks_product_equals_the_dequantized_matrix():
    blocks, scales = random_blocks((40, 3), seed=5)
    raw = openai_to_ggml(blocks, scales)  # (40, 51): 40 rows of 96 weights
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(6))
    expected = x @ dequantize_openai(blocks, scales).T  # (7, 40)
    assert (mxfp4_matmul(x, raw) - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_a_nan_scale_is_one_clear_line():
    blocks, scales = random_blocks((2, 3, 2))
    scales[1, 2, 0] = 0xFF
    with pytest.raises(CheckpointError, match="0xFF, which E8M0 reserves for NaN"):
        dequantize_openai(blocks, scales, what="model.layers.0.mlp.experts.down_proj")
    with pytest.raises(CheckpointError, match="0xFF"):
        dequantize_ggml(torch.cat([torch.tensor([255], dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]))


def test_a_scale_too_large_for_the_dtype_and_a_wrong_shape_are_refused():
    blocks, scales = random_blocks((2, 2))
    blocks[0, 0, 0], scales[0, 0] = 0x07, 254  # 6 × 2^127: past float32's largest
    with pytest.raises(CheckpointError, match="beyond the range"):
        dequantize_openai(blocks, scales)
    with pytest.raises(CheckpointError, match=r"need uint8 \(\.\.\., G, 16\)"):
        dequantize_openai(blocks[..., :8], scales)


def kernel_blocks(out_features, in_features, generator):
    """ggml's MXFP4 bytes (out, in/32 · 17): every code, scales from 0 (2^-127, whose half is subnormal) to 140."""
    blocks = torch.randint(0, 256, (out_features, in_features // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(0, 141, (out_features, in_features // 32), generator=generator, dtype=torch.uint8)
    scales[:, 0] = 127  # a block scaled by 1 in every row: no row all subnormal
    return openai_to_ggml(blocks, scales)


def test_lesson_26s_kernel_every_path_gives_the_same_bits():
    """MXFP4 on lesson 26's C paths: the vector paths this CPU runs give the plain loops' bits, and those are the
    blocks' arithmetic in torch (the row rounded to int8, times the dequantized blocks) but for the order of sums.
    Widths with an odd number of blocks (a last unit without a partner), rows of 1 and 3."""
    generator = torch.Generator().manual_seed(11)
    paths = runnable_paths()
    for in_features in (32, 544):
        raw = kernel_blocks(37, in_features, generator)  # (37, in/32 · 17)
        for rows in (1, 3):
            x = torch.randn(rows, in_features, generator=generator) * 3  # (rows, in)
            reference = gguf_blocks.multiply_with(paths["generic"], x, raw, GGML_MXFP4)  # (rows, 37)
            for name, library in paths.items():
                assert torch.equal(gguf_blocks.multiply_with(library, x, raw, GGML_MXFP4), reference), name
            torch_path = gguf_blocks.gguf_matmul_torch(x, raw, "MXFP4")
            assert (reference - torch_path).abs().max() <= 1e-5 * torch_path.abs().max()


def test_lesson_26s_kernel_is_off_the_exact_product_by_the_rounding_alone():
    """Each int8 of the row is off its float by at most half its block's step (largest |x| / 127 / 2): the product
    is off the dequantized fp32 product by at most Σ over blocks of that half step times the block's Σ|w|, and
    measurably off (the rounding is real)."""
    generator = torch.Generator().manual_seed(12)
    raw = kernel_blocks(64, 576, generator)  # (64, 576/32 · 17)
    x = torch.randn(4, 576, generator=generator)  # (4, 576)
    w = dequantize_ggml(raw).reshape(64, 576)  # (64, 576)
    exact = x @ w.T  # (4, 64)
    ours = torch.ops.hardway.gguf_matmul.default(x, raw, GGML_MXFP4)
    half_step = x.abs().unflatten(-1, (-1, 32)).amax(-1) / 127 / 2  # (4, 18)
    bound = half_step @ w.abs().unflatten(-1, (-1, 32)).sum(-1).T  # (4, 64)
    slack = 1e-5 * (x.abs() @ w.abs().T)  # fp32's own rounding in either sum
    assert ((ours - exact).abs() <= bound + slack).all()
    assert (ours - exact).abs().max() > 1e-3 * bound.max()


@pytest.mark.skipif(not all(shutil.which(tool) for tool in ARM_TOOLS), reason="needs aarch64-linux-gnu-gcc and "
                    "qemu-aarch64 (Debian: apt install gcc-aarch64-linux-gnu qemu-user)")
def test_lesson_26s_arm_path_under_an_emulator_gives_the_same_bits(tmp_path):
    c_dir = Path(gguf_blocks.__file__).parent / "c"
    program = tmp_path / "gguf_neon"
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-ffp-contract=off", "-march=armv8.2-a+dotprod", "-static",
                    "-I", str(c_dir), str(c_dir / "gguf_neon.c"), str(Path(__file__).parent / "c" / "gguf_driver.c"),
                    "-o", str(program)], check=True, capture_output=True)
    generator = torch.Generator().manual_seed(13)
    raw = kernel_blocks(21, 544, generator)  # (21, 17 · 17)
    x = torch.randn(2, 544, generator=generator)  # (2, 544)
    run = subprocess.run(["qemu-aarch64", str(program)], capture_output=True, check=True,
                         input=struct.pack("4q", GGML_MXFP4, 2, 544, 21) + x.numpy().tobytes() + raw.numpy().tobytes())
    arm = torch.frombuffer(bytearray(run.stdout), dtype=torch.float32).reshape(2, 21)
    assert torch.equal(arm, gguf_blocks.multiply_with(gguf_blocks.build_kernel("generic"), x, raw, GGML_MXFP4))
