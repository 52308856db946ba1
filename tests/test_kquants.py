"""hardway.formats.gguf_quants: every block format bit-exact with gguf.quants.dequantize, on random blocks, on a GGUF
file written by the gguf package and read back by read_gguf, and on every tensor of Gemma 3's real Q4_K_M file."""

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from hardway.formats.gguf import dequantize, gemma3_gguf, read_gguf
from hardway.formats.gguf_quants import DEQUANTIZE, TENSOR_TYPES, unpack_scales_mins
from hardway.formats.hub import models_dir

# where each type keeps its fp16 numbers (d, and dmin or m): random bytes there could be NaN or inf
FP16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
           "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(type_name: str, n: int, seed: int = 0) -> np.ndarray:
    """(n, block bytes) random bytes with sane fp16 scales: every bit pattern of the quantized part is reached."""
    qtype = gguf.GGMLQuantizationType[type_name]
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, size=(n, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in FP16_AT[type_name]:
        blocks[:, at:at + 2] = g.uniform(-3, 3, size=(n, 1)).astype(np.float16).view(np.uint8)
    return blocks


def bit_equal(a: torch.Tensor, b: np.ndarray) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int32), torch.from_numpy(b.astype(np.float32).reshape(-1)).view(torch.int32))


def test_the_block_table_is_ggmls():
    for type_id, (name, block_size, block_bytes) in TENSOR_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert qtype.name == name and gguf.GGML_QUANT_SIZES[qtype] == (block_size, block_bytes)
        assert name in DEQUANTIZE


@pytest.mark.parametrize("type_name", sorted(FP16_AT))
def test_random_blocks_are_bit_exact(type_name):
    blocks = random_blocks(type_name, 200, seed=len(type_name))
    mine = DEQUANTIZE[type_name](torch.from_numpy(blocks.reshape(-1).copy()))
    assert bit_equal(mine, gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]))


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
def test_half_precision_is_the_gguf_packages(type_name):
    raw = np.random.default_rng(2).normal(size=(3, 64)).astype(np.float32).astype(np.float16).view(np.uint8)
    if type_name == "BF16":  # bf16 is the top half of an fp32
        raw = (np.random.default_rng(2).normal(size=(3, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    mine = DEQUANTIZE[type_name](torch.from_numpy(raw.reshape(-1).copy()))
    assert bit_equal(mine, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_quantized_weights_round_trip_as_the_gguf_package(type_name):
    weights = np.random.default_rng(5).normal(0, 0.05, size=(4, 96)).astype(np.float32)
    packed = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name])  # (4, row bytes)
    mine = DEQUANTIZE[type_name](torch.from_numpy(packed.reshape(-1).copy()))
    assert bit_equal(mine, gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[type_name]))


def test_scale_unpacking_is_the_gguf_packages():
    packed = random_blocks("Q4_K", 500)[:, 4:16]  # (500, 12)
    scales, mins = unpack_scales_mins(torch.from_numpy(packed.copy()))
    their_scales, their_mins = gguf.quants.Q4_K.get_scale_min(packed)
    assert scales.tolist() == their_scales.tolist() and mins.tolist() == their_mins.tolist()
    assert int(scales.max()) > 15 and int(mins[:, 4:].max()) > 15  # the top 2 bits of sub-blocks 4-7 were used


def test_a_written_file_with_k_quant_blocks_reads_back(tmp_path):
    """Raw blocks of every K-quant (and Q5) in one GGUF file written by gguf.GGUFWriter: read_gguf finds each tensor,
    with its shape, and dequantize gives gguf.quants' floats."""
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    rows = {}
    for k, type_name in enumerate(["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]):
        block_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
        blocks = random_blocks(type_name, 3 * (512 // block_size), seed=k)  # 3 rows of 512 weights
        rows[type_name] = blocks.reshape(3, -1)  # (3, row bytes)
        writer.add_tensor(f"t.{type_name}", rows[type_name], raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = read_gguf(path)
    for type_name, raw in rows.items():
        info = file.tensors[f"t.{type_name}"]
        assert info.type_name == type_name and info.shape == (3, 512)
        assert bit_equal(dequantize(file, info.name), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))


@pytest.fixture(scope="module")
def gemma():
    return read_gguf(gemma3_gguf(models_dir() / "gguf"))


def test_every_tensor_of_the_gemma_file_is_bit_exact(gemma):
    counts = {}
    for name, info in gemma.tensors.items():
        counts[info.type_name] = counts.get(info.type_name, 0) + 1
        raw = gemma.raw(name).numpy().reshape(-1, TENSOR_TYPES[info.type_id][2])  # (blocks, block bytes)
        mine = dequantize(gemma, name)
        assert mine.shape == info.shape
        assert bit_equal(mine, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[info.type_name])), name
    assert counts == {"F32": 109, "Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9}
