"""Qwen3.5 in a GGUF (lesson 28): a tiny Qwen3_5ForCausalLM checkpoint, written to a `qwen35` GGUF here exactly as
llama.cpp's converter writes it (`write_qwen35_gguf`), read back by gguf_config and gguf_checkpoint.

What the converter writes was read off its own output: llama.cpp's convert_hf_to_gguf.py (the copy vendored in the
llama-cpp-python 0.3.36 source package, class Qwen3_5TextModel) run on the checkpoint `tiny_checkpoint` builds, with
--outtype f32 and q8_0, with and without its multi-token prediction block. tests/data/qwen35_converter.json holds what
it wrote: every metadata key and value, every tensor's name, type, shape and SHA-256 (ssm_a's values, which pass
through exp, as numbers). The converter is not a dependency, so the tests hold `write_qwen35_gguf` to that record
byte for byte, then use it.

The checkpoint's weights come from integer arithmetic, not a random generator, so that the same folder is built on
any machine and the record's hashes stay true."""

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hardway.errors import CheckpointError, ConfigError
from hardway.formats.gguf import GGUFError, dequantize, gguf_checkpoint, gguf_config, read_gguf
from hardway.formats.gguf_archs import ARCHITECTURES

RECORD = Path(__file__).parent / "data" / "qwen35_converter.json"
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_config(n_k_heads: int = 2, n_v_heads: int = 4, mtp: bool = False, **sizes) -> dict:
    """A Qwen3.5 text config.json, every size small, its rows multiples of 32 (Q8_0's block). More value heads than
    key heads: the converter then reorders the value heads, the change most easily undone wrongly. `sizes`: other
    values for any of its keys."""
    config = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 272, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_num_key_heads": n_k_heads, "linear_num_value_heads": n_v_heads, "layer_types": LAYER_TYPES,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        "bos_token_id": None, "eos_token_id": 263, "pad_token_id": None, "dtype": "float32",
    }
    if mtp:
        config["mtp_num_hidden_layers"] = 1
    return {**config, **sizes}


def numbers(shape, salt: int, scale: float = 0.05, offset: float = 0.0) -> torch.Tensor:
    """Deterministic weights in [-scale, scale] + offset: integer arithmetic, then one exactly rounded division."""
    n = int(np.prod(shape))
    k = (np.arange(n, dtype=np.int64) * 7919 + salt * 104729) % 2001 - 1000  # -1000..1000, spread out
    return torch.from_numpy((k / 1000 * scale + offset).astype(np.float32).reshape(shape))


def tiny_tensors(config: dict, mtp: bool = False) -> dict:
    """Every tensor of a Qwen3_5ForCausalLM with `config`, by its hub name. Norms around 0 (the model scales by
    1 + w), the gated norm around 1 (it scales by w), A_log in [-1, 1]."""
    C, V, ff = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    H, KV, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv, K = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    conv = 2 * nk * dk + nv * dv
    salt = iter(range(1, 10_000))
    t = {"model.embed_tokens.weight": numbers((V, C), next(salt)), "model.norm.weight": numbers((C,), next(salt), 0.3),
         "lm_head.weight": numbers((V, C), next(salt))}

    def attention_layer(p):
        t.update({p + "self_attn.q_proj.weight": numbers((2 * H * d, C), next(salt)),
                  p + "self_attn.k_proj.weight": numbers((KV * d, C), next(salt)),
                  p + "self_attn.v_proj.weight": numbers((KV * d, C), next(salt)),
                  p + "self_attn.o_proj.weight": numbers((C, H * d), next(salt)),
                  p + "self_attn.q_norm.weight": numbers((d,), next(salt), 0.3),
                  p + "self_attn.k_norm.weight": numbers((d,), next(salt), 0.3)})

    def mlp(p):
        t.update({p + "input_layernorm.weight": numbers((C,), next(salt), 0.3),
                  p + "post_attention_layernorm.weight": numbers((C,), next(salt), 0.3),
                  p + "mlp.gate_proj.weight": numbers((ff, C), next(salt)),
                  p + "mlp.up_proj.weight": numbers((ff, C), next(salt)),
                  p + "mlp.down_proj.weight": numbers((C, ff), next(salt))})

    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        mlp(p)
        if kind == "full_attention":
            attention_layer(p)
            continue
        t.update({p + "linear_attn.in_proj_qkv.weight": numbers((conv, C), next(salt)),
                  p + "linear_attn.in_proj_z.weight": numbers((nv * dv, C), next(salt)),
                  p + "linear_attn.in_proj_b.weight": numbers((nv, C), next(salt)),
                  p + "linear_attn.in_proj_a.weight": numbers((nv, C), next(salt)),
                  p + "linear_attn.conv1d.weight": numbers((conv, 1, K), next(salt), 0.3),
                  p + "linear_attn.dt_bias": numbers((nv,), next(salt), 1.0),
                  p + "linear_attn.A_log": numbers((nv,), next(salt), 1.0),
                  p + "linear_attn.norm.weight": numbers((dv,), next(salt), 0.3, 1.0),
                  p + "linear_attn.out_proj.weight": numbers((C, nv * dv), next(salt))})
    if mtp:  # the multi-token prediction block, as Qwen3.5's checkpoints name it: not part of the causal LM
        mlp("mtp.layers.0.")
        attention_layer("mtp.layers.0.")
        t.update({"mtp.fc.weight": numbers((C, 2 * C), next(salt)), "mtp.norm.weight": numbers((C,), next(salt)),
                  "mtp.pre_fc_norm_embedding.weight": numbers((C,), next(salt)),
                  "mtp.pre_fc_norm_hidden.weight": numbers((C,), next(salt))})
    return t


def tiny_checkpoint(folder: Path, n_k_heads: int = 2, n_v_heads: int = 4, mtp: bool = False, **sizes) -> Path:
    """A Qwen3.5 checkpoint folder: config.json, model.safetensors and a byte-level BPE tokenizer (the 256 bytes, five
    merges, three special tokens) that transformers and llama.cpp's converter both read. `sizes`: tiny_config's."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(n_k_heads, n_v_heads, mtp, **sizes)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tiny_tensors(config, mtp), folder / "model.safetensors", metadata={"format": "pt"})
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(folder)
    return folder


# The converter's names: model.layers.N.<hub> -> blk.N.<gguf>
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
MTP_NAMES = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
             "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


# The norms the converter stores as 1 + w: every name ending in norm.weight once it has renamed the draft block's
# (pre_fc_norm_embedding -> enorm), except the Gated DeltaNet's gated norm, which multiplies by w itself.
PLUS_ONE = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def tiled(w: torch.Tensor, dim: int, n_k: int, n_v: int, head_dim: int) -> torch.Tensor:
    """The converter's value-head order along `dim`: grouped by key head (k0's v0, k0's v1, k1's v0, ...) becomes
    tiled (k0's v0, k1's v0, k0's v1, ...), so that ggml repeats the key heads by tiling them."""
    if n_k == n_v:
        return w
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], n_k, n_v // n_k, head_dim, *shape[dim + 1:])
    return w.transpose(dim, dim + 1).reshape(shape)


def converted(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    """One hub tensor as the converter changes it (Qwen3NextModel and _LinearAttentionVReorderBase.modify_tensors)."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    keys = 2 * nk * dk  # the q and k rows (channels) before the value heads'
    if ".linear_attn." in name:
        if ".in_proj_qkv." in name:
            w = torch.cat([w[:keys], tiled(w[keys:], 0, nk, nv, dv)])
        elif ".in_proj_z." in name:
            w = tiled(w, 0, nk, nv, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            w = tiled(w, 0, nk, nv, 1)
        elif ".conv1d." in name:
            w = w.squeeze()
            w = torch.cat([w[:keys], tiled(w[keys:], 0, nk, nv, dv)])
        elif ".out_proj." in name:
            w = tiled(w, 1, nk, nv, dv)
    if name.endswith(".A_log"):
        w = -torch.exp(w)
    elif name.endswith(PLUS_ONE) and not name.endswith("linear_attn.norm.weight"):
        w = w + 1  # the model multiplies by 1 + w; ggml's norm by the stored value
    return w


def gguf_name(name: str, n_layers: int) -> str:
    if name in GLOBAL:
        return GLOBAL[name]
    if name.startswith("mtp."):
        rest = name.removeprefix("mtp.")
        if rest.startswith("layers.0."):
            return f"blk.{n_layers}.{GGUF_NAMES[rest.removeprefix('layers.0.')]}"
        return f"blk.{n_layers}.{MTP_NAMES[rest]}"
    _, _, i, rest = name.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest]}"


def write_qwen35_gguf(folder: Path, path: Path, outtype: str = "f32", mtp: bool = True) -> Path:
    """The GGUF llama.cpp's converter writes from the checkpoint `folder` (`--outtype f32` or `q8_0`; mtp=False:
    `--no-mtp`): the same metadata, the same tensors, changed as it changes them, in the same order."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    hub = load_file(folder / "model.safetensors")
    n_layers = config["num_hidden_layers"]
    n_mtp = config.get("mtp_num_hidden_layers", 0) if mtp else 0
    if not mtp:
        hub = {k: v for k, v in hub.items() if not k.startswith("mtp.")}
    arch = "qwen35"
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_type("model")
    writer.add_block_count(n_layers + n_mtp)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config["rope_parameters"]
    writer.add_rope_dimension_sections(rope["mrope_section"] + [0])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == "f32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [t == "linear_attention" for t in config["layer_types"]] + [False] * n_mtp)
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    if n_mtp:
        writer.add_nextn_predict_layers(n_mtp)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(config["vocab_size"])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.UNUSED if i not in by_id else gguf.TokenType.CONTROL
                            if by_id[i] in added else gguf.TokenType.NORMAL for i in range(config["vocab_size"])])
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)
    for name, w in hub.items():  # safetensors' order: sorted by name, as the converter reads them
        w = converted(name, w, config)
        new = gguf_name(name, n_layers)
        data = w.numpy()
        quantize = outtype == "q8_0" and data.ndim > 1 and not new.endswith(("_norm.weight", "ssm_conv1d.weight"))
        if quantize:
            writer.add_tensor(new, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(new, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def record_of(path: Path) -> dict:
    """What a GGUF holds, as tests/data/qwen35_converter.json records it: metadata (tokenizer lists by length and
    hash), and each tensor's type, shape (ggml order) and SHA-256, or values for ssm_a."""
    reader = gguf.GGUFReader(path)
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) > 16:
            value = {"length": len(value), "sha256": hashlib.sha256(json.dumps(value).encode()).hexdigest()}
        meta[key] = value
    tensors = {}
    for t in reader.tensors:
        entry = {"type": t.tensor_type.name, "dims": [int(d) for d in t.shape]}
        if t.name.endswith("ssm_a"):
            entry["values"] = [float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1)]
        else:
            entry["sha256"] = hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()
        tensors[t.name] = entry
    return {"metadata": meta, "tensor_order": [t.name for t in reader.tensors], "tensors": tensors}


IGNORED_KEYS = {"general.name", "general.size_label"}  # from the folder's name and the parameter count: not the model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"plain": the tiny checkpoint, "mtp": the same with a multi-token prediction block}."""
    root = tmp_path_factory.mktemp("qwen35")
    return {"plain": tiny_checkpoint(root / "qwen35-tiny"), "mtp": tiny_checkpoint(root / "qwen35-tiny-mtp", mtp=True)}


@pytest.mark.parametrize("run, outtype, mtp", [("f32", "f32", True), ("f32-no-mtp", "f32", False),
                                               ("q8_0-no-mtp", "q8_0", False)])
def test_the_writer_writes_what_the_converter_wrote(folders, tmp_path, run, outtype, mtp):
    expected = json.loads(RECORD.read_text())[run]
    ours = record_of(write_qwen35_gguf(folders["mtp"], tmp_path / f"{run}.gguf", outtype, mtp=mtp))
    assert ours["metadata"] == {k: v for k, v in expected["metadata"].items() if k not in IGNORED_KEYS}
    assert ours["tensor_order"] == expected["tensor_order"]
    for name, entry in expected["tensors"].items():
        if "values" in entry:  # ssm_a = -exp(A_log): exp may round differently on another machine
            assert ours["tensors"][name]["dims"] == entry["dims"]
            np.testing.assert_allclose(ours["tensors"][name]["values"], entry["values"], rtol=2 ** -22)
        else:
            assert ours["tensors"][name] == entry, name


def test_the_record_has_every_change_the_converter_makes():
    """The record itself shows the converter's changes: value heads tiled (n_k != n_v), the draft block appended."""
    record = json.loads(RECORD.read_text())
    meta = record["f32"]["metadata"]
    assert meta["qwen35.ssm.group_count"] == 2 and meta["qwen35.ssm.time_step_rank"] == 4
    assert meta["qwen35.block_count"] == 5 and meta["qwen35.nextn_predict_layers"] == 1
    assert meta["qwen35.attention.recurrent_layers"] == [True, False, True, False, False]
    assert "blk.4.nextn.eh_proj.weight" in record["f32"]["tensors"]
    assert record["f32"]["tensors"]["blk.0.ssm_conv1d.weight"]["dims"] == [4, 256]  # (D, K): squeezed
    assert record["q8_0-no-mtp"]["tensors"]["blk.0.ssm_conv1d.weight"]["type"] == "F32"
    assert record["q8_0-no-mtp"]["tensors"]["blk.0.ssm_out.weight"]["type"] == "Q8_0"


def hub_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file
    return {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("mtp.")}


def test_the_config_is_the_checkpoints(folders, tmp_path):
    path = write_qwen35_gguf(folders["mtp"], tmp_path / "f32.gguf")  # with the draft block: not a layer
    ours, saved = gguf_config(path), json.loads((folders["mtp"] / "config.json").read_text())
    keys = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "layer_types",
            "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "tie_word_embeddings", "max_position_embeddings", "attention_bias",
            "rope_parameters"]
    assert {k: ours[k] for k in keys} == {k: saved[k] for k in keys}
    assert np.float32(ours["rms_norm_eps"]) == np.float32(saved["rms_norm_eps"])
    assert ours["eos_token_id"] == 263  # <|im_end|>: the converter writes the tokenizer's


@pytest.mark.parametrize("mtp", [False, True])
def test_every_tensor_comes_back(folders, tmp_path, mtp):
    """f32: each tensor the converter only moved comes back bit for bit; a norm as (1 + w) - 1 exactly; A_log to
    within the rounding of exp then log. The names are transformers' state_dict's, the draft block's left out."""
    from transformers import AutoModelForCausalLM

    folder = folders["mtp" if mtp else "plain"]
    ckpt = gguf_checkpoint(write_qwen35_gguf(folder, tmp_path / "f32.gguf", mtp=mtp))
    hub = hub_tensors(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert ckpt.tensors.keys() == hub.keys() == reference.state_dict().keys()
    for name, w in hub.items():
        ours = ckpt.tensors[name]
        assert ours.shape == w.shape, name
        if name.endswith("A_log"):
            assert torch.allclose(ours, w, rtol=0, atol=2 ** -21), name  # |A_log| <= 1: a few ulps of 1
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            assert torch.equal(ours, (w + 1) - 1), name
        else:
            assert torch.equal(ours, w), name


def test_value_heads_go_back_to_their_key_heads(folders, tmp_path):
    """The reorder undone is the right one, not merely a permutation: in_proj_a's row j is value head j's."""
    ckpt = gguf_checkpoint(write_qwen35_gguf(folders["plain"], tmp_path / "f32.gguf"))
    file = read_gguf(tmp_path / "f32.gguf")
    hub = hub_tensors(folders["plain"])
    a_file = dequantize(file, "blk.0.ssm_alpha.weight")  # rows: k0's v0, k1's v0, k0's v1, k1's v1
    a_hub = hub["model.layers.0.linear_attn.in_proj_a.weight"]  # rows: k0's v0, k0's v1, k1's v0, k1's v1
    assert torch.equal(a_file[[0, 2, 1, 3]], a_hub) and not torch.equal(a_file, a_hub)
    assert torch.equal(ckpt.tensors["model.layers.0.linear_attn.in_proj_a.weight"], a_hub)


def test_q8_0_is_within_each_blocks_step(folders, tmp_path):
    """Every quantized weight read back is within its own block's bound, d/2 plus d's fp16 rounding (d = max|w| /
    127 over the block's 32 weights, in the file's order), in the hub's order; what stays f32 is exact."""
    f32 = gguf_checkpoint(write_qwen35_gguf(folders["plain"], tmp_path / "f32.gguf"))
    path = write_qwen35_gguf(folders["plain"], tmp_path / "q8_0.gguf", "q8_0")
    q8, file = gguf_checkpoint(path), read_gguf(path)
    config = json.loads((folders["plain"] / "config.json").read_text())
    hub = hub_tensors(folders["plain"])
    quantized = 0
    for file_name, info in file.tensors.items():
        name = next(n for n in hub if gguf_name(n, 4) == file_name)
        if info.type_name != "Q8_0":
            assert torch.equal(q8.tensors[name], f32.tensors[name]), name
            continue
        quantized += 1
        in_file = converted(name, hub[name], config)  # (rows, cols) in the file's order
        blocks = in_file.reshape(in_file.shape[0], -1, 32)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        bound = (d / 2 + 127 * d * 2 ** -11).expand_as(blocks).reshape(in_file.shape)
        error = (dequantize(file, file_name) - in_file).abs()
        assert (error <= bound * (1 + 1e-6)).all(), file_name
        back = (q8.tensors[name] - hub[name]).abs()  # the same errors, moved to the hub's order
        assert torch.equal(back, ARCHITECTURES["qwen35"].restore(name, error, config)), name
    assert quantized == 2 * 5 + 2 * 4 + 4 * 3 + 2  # every matrix but the convolutions: the Gated DeltaNet layers'
    # five, the attention layers' four, the MLPs' three, the embedding and the head


def rewrite(source_path: Path, path: Path, drop=(), shapes=None, metadata=None, remove_keys=()) -> Path:
    """A copy of a GGUF with tensors dropped, some replaced by zeros of another shape (`shapes`: {name: torch
    shape}), metadata keys set (`metadata`: {key: list of bools}) or removed."""
    source = read_gguf(source_path)
    writer = gguf.GGUFWriter(path, arch=source.metadata["general.architecture"])
    for key, value in source.metadata.items():
        if key in remove_keys or key in (metadata or {}) or key.startswith("general.") or key.startswith("GGUF."):
            continue
        kind = source.value_types[key]
        sub = gguf.GGUFValueType[kind[6:-1]] if kind.startswith("ARRAY") else None
        writer.add_key_value(key, value, gguf.GGUFValueType[kind.split("[")[0]], sub_type=sub)
    for key, value in (metadata or {}).items():
        writer.add_array(key, value)
    for name in source.tensors:
        if name in drop:
            continue
        w = dequantize(source, name).numpy()
        writer.add_tensor(name, np.zeros((shapes or {}).get(name, w.shape), np.float32) if name in (shapes or {}) else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("change, error, message", [
    ({"drop": ["blk.2.ssm_a"]}, CheckpointError,
     "blk.2.ssm_a is missing: the metadata makes layer 2 a linear_attention layer"),
    ({"drop": ["blk.0.ssm_conv1d.weight"]}, CheckpointError,
     "blk.0.ssm_conv1d.weight is missing: the metadata makes layer 0 a linear_attention layer"),
    ({"shapes": {"blk.0.ssm_conv1d.weight": (256, 3)}}, CheckpointError,
     "blk.0.ssm_conv1d.weight has shape (256, 3); the metadata's ssm.* sizes make it (256, 4)"),
    ({"shapes": {"blk.2.attn_qkv.weight": (192, 32)}}, CheckpointError,
     "blk.2.attn_qkv.weight has shape (192, 32); the metadata's ssm.* sizes make it (256, 32)"),
    ({"metadata": {"qwen35.attention.recurrent_layers": [False, False, True, False]}}, CheckpointError,
     "blk.0.attn_q.weight is missing: the metadata makes layer 0 a full_attention layer"),
    ({"metadata": {"qwen35.attention.recurrent_layers": [True, True, True, False]}}, CheckpointError,
     "blk.1.attn_qkv.weight is missing: the metadata makes layer 1 a linear_attention layer"),
    ({"metadata": {"qwen35.attention.recurrent_layers": [True, False, True]}}, ConfigError,
     "qwen35.attention.recurrent_layers must be one bool for each of the 4 blocks, got [True, False, True]: "
     "the layer layout is unknown"),
    ({"remove_keys": ["qwen35.ssm.time_step_rank"]}, GGUFError, "metadata has no ['qwen35.ssm.time_step_rank']"),
])
def test_a_file_that_does_not_fit_its_metadata_is_one_line(folders, tmp_path, change, error, message):
    good = write_qwen35_gguf(folders["plain"], tmp_path / "good.gguf", mtp=False)
    bad = rewrite(good, tmp_path / "bad.gguf", **change)
    import hardway

    for read in (gguf_checkpoint, hardway.load):
        with pytest.raises(error) as e:
            read(bad)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_layer_layout_falls_back_on_the_interval(folders, tmp_path):
    """A file without recurrent_layers: llama.cpp's rule, every full_attention_interval-th layer attends."""
    good = write_qwen35_gguf(folders["plain"], tmp_path / "good.gguf", mtp=False)
    no_list = rewrite(good, tmp_path / "no_list.gguf", remove_keys=["qwen35.attention.recurrent_layers",
                                                                    "qwen35.full_attention_interval"])
    assert gguf_config(no_list)["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]  # the default, 4
    with pytest.raises(CheckpointError, match="blk.1.attn_qkv.weight is missing"):
        gguf_checkpoint(no_list)  # this file's layer 1 attends: without its list, the file does not fit


IDS = torch.tensor([[5, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 261, 7, 200]])  # (1, 16)


def test_the_f32_file_is_the_folder_and_transformers(folders, tmp_path):
    """hardway.load of the f32 file against hardway.load of the folder it came from, and against transformers'
    model of that folder. The file's weights differ from the folder's only by the roundings of 1 + w (2^-24 at most
    for these norms) and of exp/log in A_log (a few ulps): logits of order 1 move by ~1e-6, so 1e-5 both ways."""
    import hardway
    from transformers import AutoModelForCausalLM

    # the file with the draft block, which is not read; the folder without it (the same weights otherwise)
    path = write_qwen35_gguf(folders["mtp"], tmp_path / "f32.gguf")
    reference = AutoModelForCausalLM.from_pretrained(folders["plain"], dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(IDS).logits
        from_folder, from_file = hardway.load(folders["plain"])(IDS), hardway.load(path)(IDS)
    assert (from_file - from_folder).abs().max().item() < 1e-5
    assert (from_file - theirs).abs().max().item() < 1e-5
    assert torch.equal(from_file.argmax(-1), theirs.argmax(-1))


def test_the_q8_0_file_is_within_its_rounding(folders, tmp_path):
    """hardway.load of the q8_0 file against the f32 one. Q8_0 moves each weight by at most half its block's step,
    d / 2 (d = max|w| / 127 over 32 weights), in a way that behaves as noise. The yardstick is that noise itself: the
    f32 checkpoint with every quantized matrix moved by uniform noise in [-d/2, d/2] of its own blocks, five draws. The
    q8_0 file's logits may be off the f32 ones by no more than twice the largest of those draws."""
    import hardway
    from hardway.models.qwen3_5 import Qwen35

    f32_path = write_qwen35_gguf(folders["plain"], tmp_path / "f32.gguf", mtp=False)
    q8_path = write_qwen35_gguf(folders["plain"], tmp_path / "q8_0.gguf", "q8_0", mtp=False)
    quantized = {hub for hub in gguf_checkpoint(f32_path).tensors
                 if any(info.type_name == "Q8_0" and name_of(name) == hub
                        for name, info in read_gguf(q8_path).tensors.items())}
    with torch.no_grad():
        exact = hardway.load(f32_path)(IDS)
        delta = (hardway.load(q8_path)(IDS) - exact).abs().max().item()
        generator, noise = torch.Generator().manual_seed(0), []
        for _ in range(5):
            ckpt = gguf_checkpoint(f32_path)
            for hub in quantized:
                w = ckpt.tensors[hub]  # (out, in): blocks of 32 along each row, in either order the same sizes
                d = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127  # (out, blocks, 1)
                u = torch.rand(w.shape[0], w.shape[1] // 32, 32, generator=generator) - 0.5
                ckpt.tensors[hub] = w + (u * d).reshape(w.shape)
            noise.append((Qwen35.from_checkpoint(ckpt)(IDS) - exact).abs().max().item())
    assert 0 < delta <= 2 * max(noise), (delta, noise)


def name_of(file_name: str) -> str:
    from hardway.formats.gguf import hub_name
    return hub_name(file_name, "qwen35")
