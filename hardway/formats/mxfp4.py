"""MXFP4 (OCP's microscaling FP4): weights in blocks of 32, each a 4-bit E2M1 float (±0, 0.5, 1, 1.5, 2, 3, 4, 6)
sharing one power-of-two scale, an E8M0 byte (2^(byte - 127); 0xFF is NaN). 4.25 bits a weight.

Two layouts of the same numbers: openai's gpt-oss safetensors (`<name>_blocks` (..., n/32, 16) uint8, element 2j in
the low nibble of byte j and 2j + 1 in its high nibble, beside `<name>_scales` (..., n/32) uint8) and a GGUF's
MXFP4 type (ggml type 39: 17 bytes a block, the scale byte, then element j in the low nibble of byte j and j + 16 in
its high nibble, as Q4_0's). Both dequantized bit for bit as transformers and the gguf package do; the GGUF's
blocks multiplied as they are, by `mxfp4_matmul` (lesson 26's torch path, for this block)."""

from __future__ import annotations

import torch

from hardway.contract import Checkpoint
from hardway.errors import CheckpointError
from hardway.formats.gguf_quants import DEQUANTIZE, TENSOR_TYPES  # lesson 16
from hardway.kernels.quantized import round_activations  # lesson 26

BLOCK = 32  # weights a block
GGML_MXFP4 = 39  # ggml's type id
BLOCK_BYTES = 1 + BLOCK // 2  # a GGUF block: the scale byte, then 16 bytes of nibbles
E8M0_NAN = 0xFF  # the one scale byte that is no number
E8M0_BIAS = 127  # byte b means 2^(b - 127)
# E2M1 (1 sign, 2 exponent, 1 mantissa bit) by its 4-bit code: sign is the top bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# ggml's table (gguf's MXFP4.kvalues, halved) has +0 for code 8, where transformers' has -0: each is matched bit
# for bit (the two zeros multiply alike)
GGML_VALUES = FP4_VALUES[:8] + (0.0,) + FP4_VALUES[9:]
ROWS_AT_ONCE = 4096  # rows mxfp4_matmul dequantizes at a time


def check_scales(scales: torch.Tensor, what: str) -> None:
    """A CheckpointError naming `what` if any scale byte is 0xFF, E8M0's NaN: every weight of its block would be NaN."""
    bad = scales == E8M0_NAN
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"{what}: {int(bad.sum())} MXFP4 scale(s) are 0xFF, which E8M0 reserves for NaN "
                              f"(the first at index {where}): the file is damaged")


def dequantize_openai(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32, what: str = "MXFP4") -> torch.Tensor:
    """blocks (..., G, 16) uint8 and scales (..., G) uint8, openai's layout -> (..., G · 32) in `dtype`: each byte's
    low nibble then its high nibble looked up in FP4_VALUES (in `dtype`), times 2^(scale - 127) by torch.ldexp, as
    transformers' convert_moe_packed_tensors computes it (whose result it returns transposed: (E, n, rows))."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != BLOCK // 2:
        raise CheckpointError(f"{what}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                              f"{tuple(scales.shape)} {scales.dtype}: need uint8 (..., G, 16) and uint8 (..., G)")
    check_scales(scales, what)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)  # (16,)
    out = torch.empty(*blocks.shape[:-1], BLOCK, dtype=dtype, device=blocks.device)  # (..., G, 32)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]  # element 2j: the low nibble of byte j
    out[..., 1::2] = lut[(blocks >> 4).long()]  # element 2j + 1: the high nibble
    torch.ldexp(out, (scales.to(torch.int32) - E8M0_BIAS)[..., None], out=out)  # × 2^(scale - 127), exact
    if not bool(torch.isfinite(out).all()):
        raise CheckpointError(f"{what}: MXFP4 scales up to {int(scales.max())} make weights beyond the range of "
                              f"{dtype}")
    return out.flatten(-2)  # (..., G · 32)


def openai_to_ggml(blocks: torch.Tensor, scales: torch.Tensor, what: str = "MXFP4") -> torch.Tensor:
    """openai's blocks (..., G, 16) and scales (..., G) -> ggml's MXFP4 bytes (..., G · 17): per block the scale,
    then the 32 codes re-paired so that byte j holds element j (low) and j + 16 (high), as llama.cpp's converter
    writes them (its transform_nibble_layout)."""
    check_scales(scales, what)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # (..., G, 32): element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # (..., G, 16)
    return torch.cat((scales[..., None], packed), dim=-1).flatten(-2)  # (..., G · 17)


def ggml_to_openai(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse: ggml's bytes (..., G · 17) -> openai's blocks (..., G, 16) and scales (..., G)."""
    blocks = raw.unflatten(-1, (-1, BLOCK_BYTES))  # (..., G, 17)
    codes = torch.cat((blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4), dim=-1)  # (..., G, 32)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), blocks[..., 0].contiguous()


def dequantize_ggml(raw: torch.Tensor) -> torch.Tensor:
    """fp32 weights from ggml's MXFP4 bytes (n_blocks · 17,) -> (n_blocks · 32,), bit for bit as the gguf package's
    MXFP4.dequantize (and ggml's C): code j in the low nibbles, j + 16 in the high ones, times 2^(scale - 127)."""
    blocks = raw.reshape(-1, BLOCK_BYTES)  # (n_blocks, 17)
    check_scales(blocks[:, 0], "MXFP4 block")
    codes = torch.cat((blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4), dim=1).long()  # (n_blocks, 32)
    w = torch.tensor(GGML_VALUES, dtype=torch.float32, device=raw.device)[codes]  # (n_blocks, 32)
    return torch.ldexp(w, blocks[:, :1].to(torch.int32) - E8M0_BIAS).reshape(-1)  # (n_blocks · 32,)


def quantize_openai(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., n), n a multiple of 32 -> openai's (blocks (..., n/32, 16), scales (..., n/32)): each block's scale
    2^(⌊log2 max|w|⌋ - 2), so its largest weight lands in [4, 8) and rounds to 4 or 6, and each weight the nearest
    E2M1 value (the first of equals), as the gguf package's MXFP4.quantize chooses; a block of zeros gets scale 0."""
    x = w.float().unflatten(-1, (-1, BLOCK))  # (..., G, 32)
    amax = x.abs().amax(dim=-1)  # (..., G)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + E8M0_BIAS, torch.zeros_like(amax))
    scales = exponent.clamp(0, 254).to(torch.uint8)  # (..., G)
    step = torch.ldexp(torch.ones_like(amax), scales.to(torch.int32) - E8M0_BIAS - 1)  # (..., G): half the scale
    doubled = 2 * torch.tensor(FP4_VALUES)  # (16,): the values ×2, so that `step` (×½) gives them back exactly
    errors = (step[..., None, None] * doubled - x[..., None]).abs()  # (..., G, 32, 16)
    codes = errors.argmin(dim=-1).to(torch.uint8)  # (..., G, 32): the first of equal errors
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, round_x: bool = False) -> torch.Tensor:
    """x (rows, in) times the matrix whose rows are ggml's MXFP4 `blocks` (out, in/32 · 17), transposed ->
    (rows, out). Lesson 26's torch path for one more block type: a slice of rows dequantized at a time, never the
    whole matrix. round_x: x first rounded to int8 in blocks of 32 (lesson 26's round_activations), as llama.cpp
    multiplies an MXFP4 row by a Q8_0 one; by default x as it is, so the product is the dequantized model's."""
    xr = round_activations(x) if round_x else x.float()  # (rows, in) fp32
    y = xr.new_empty(x.shape[0], blocks.shape[0])  # (rows, out)
    for lo in range(0, blocks.shape[0], ROWS_AT_ONCE):
        w = dequantize_ggml(blocks[lo:lo + ROWS_AT_ONCE]).reshape(-1, x.shape[1])  # (slice, in)
        y[:, lo:lo + ROWS_AT_ONCE] = xr @ w.T
    return y.to(x.dtype)


# lesson 16's reader learns the type: its size (a GGUF's tensor table is checked by it) and its dequantizer
TENSOR_TYPES[GGML_MXFP4] = ("MXFP4", BLOCK, BLOCK_BYTES)
DEQUANTIZE["MXFP4"] = dequantize_ggml


GGUF_LAYER_NAMES = {  # blk.N.<GGUF name> -> model.layers.N.<hub name>, as llama.cpp's `gpt-oss` names them
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias", "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                    ("output", "o")) for kind in ("weight", "bias")},
}


def gguf_config(meta: dict) -> dict:
    """A gpt_oss config.json dict from a GGUF's metadata (`gpt-oss.*`). llama.cpp's gpt-oss alternates a sliding
    layer and a full one, starting with a sliding one, as every gpt-oss checkpoint does; its YaRN ramp is not
    rounded (the hub config's truncate=false)."""
    a = "gpt-oss."
    missing = [a + k for k in ("embedding_length", "block_count", "attention.head_count", "expert_count",
                               "expert_used_count", "attention.sliding_window") if a + k not in meta]
    if meta.get("general.architecture") != "gpt-oss" or missing:
        raise CheckpointError(f"not a gpt-oss GGUF (general.architecture {meta.get('general.architecture')!r}"
                              f"{', metadata has no ' + str(missing) if missing else ''})")
    n_layers, n_heads = meta[a + "block_count"], meta[a + "attention.head_count"]
    rope = {"rope_type": "default", "rope_theta": meta.get(a + "rope.freq_base", 150_000.0)}
    if meta.get(a + "rope.scaling.type") == "yarn":
        rope |= {"rope_type": "yarn", "factor": meta[a + "rope.scaling.factor"], "truncate": False,
                 "original_max_position_embeddings": meta[a + "rope.scaling.original_context_length"],
                 "beta_fast": meta.get(a + "rope.scaling.yarn_beta_fast", 32.0),
                 "beta_slow": meta.get(a + "rope.scaling.yarn_beta_slow", 1.0)}
    return {"model_type": "gpt_oss", "vocab_size": meta.get(a + "vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
            "hidden_size": meta[a + "embedding_length"],
            "intermediate_size": meta.get(a + "expert_feed_forward_length", meta.get(a + "feed_forward_length")),
            "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
            "num_key_value_heads": meta.get(a + "attention.head_count_kv", n_heads),
            "head_dim": meta.get(a + "attention.key_length", meta[a + "embedding_length"] // n_heads),
            "max_position_embeddings": meta.get(a + "context_length", 131_072),
            "rms_norm_eps": meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5),
            "num_local_experts": meta[a + "expert_count"], "num_experts_per_tok": meta[a + "expert_used_count"],
            "sliding_window": meta[a + "attention.sliding_window"], "rope_parameters": rope,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}


def gguf_checkpoint(path) -> Checkpoint:
    """A gpt-oss GGUF (llama.cpp's converter's `gpt-oss`) as the `Checkpoint` openai's safetensors would give: its
    experts' MXFP4 blocks turned back into openai's `_blocks` and `_scales` (gate and up, which the converter split
    into two tensors, interleaved again row by row), everything else dequantized (lesson 16) to fp32 under its hub
    name. GptOss.from_checkpoint then dequantizes the experts or keeps them as blocks."""
    from hardway.formats.gguf import GLOBAL_NAMES, dequantize, read_gguf  # lesson 16
    file = read_gguf(path)
    config = gguf_config(file.metadata)
    tensors, halves = {}, {}
    for name, info in file.tensors.items():
        parts = name.split(".")
        if parts[0] != "blk":
            if parts[0] not in GLOBAL_NAMES:
                raise CheckpointError(f"{path}: tensor {name!r} is not part of a gpt-oss model")
            tensors[f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"] = dequantize(file, name)
            continue
        layer, rest = int(parts[1]), ".".join(parts[2:])
        hub = f"model.layers.{layer}.mlp.experts."
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            if info.type_name != "MXFP4":
                raise CheckpointError(f"{path}: {name} is {info.type_name}; a gpt-oss GGUF's experts are MXFP4")
            raw = file.raw(name).reshape(*info.shape[:-1], -1)  # (E, rows, G · 17)
            if rest.startswith("ffn_down"):
                tensors[hub + "down_proj_blocks"], tensors[hub + "down_proj_scales"] = ggml_to_openai(raw)
            else:
                halves.setdefault((layer, "weight"), {})[rest.split("_")[1]] = raw
        elif rest in ("ffn_gate_exps.bias", "ffn_up_exps.bias"):
            halves.setdefault((layer, "bias"), {})[rest.split("_")[1]] = dequantize(file, name)  # (E, H)
        elif rest in GGUF_LAYER_NAMES:
            tensors[f"model.layers.{layer}.{GGUF_LAYER_NAMES[rest]}"] = dequantize(file, name)
        else:
            raise CheckpointError(f"{path}: tensor {name!r} is not part of a gpt-oss model")
    for (layer, kind), pair in halves.items():
        if set(pair) != {"gate", "up"}:
            raise CheckpointError(f"{path}: layer {layer} has ffn_gate_exps.{kind} without ffn_up_exps.{kind} or "
                                  f"the other way round")
        both = torch.stack((pair["gate"], pair["up"]), dim=2).flatten(1, 2)  # (E, 2H, ...): gate j, up j, ...
        hub = f"model.layers.{layer}.mlp.experts.gate_up_proj"
        if kind == "bias":
            tensors[hub + "_bias"] = both
        else:
            tensors[hub + "_blocks"], tensors[hub + "_scales"] = ggml_to_openai(both)
    eos = config.pop("eos_token_id")
    return Checkpoint(file.path.parent, config, [] if eos is None else [eos], tensors)
