"""hardway.formats.gguf_archs through gguf_config and gguf_checkpoint: tiny random Qwen3, Qwen3-MoE and Qwen2 files
written here as llama.cpp's converter writes them, each against transformers' reading of the same file: the config key
by key, every tensor of the state_dict (`compare`; tests/test_gemma3_file.py runs it on Gemma 3's real file, with the
transformers model it loads once). An unknown architecture is refused in one line."""

import gguf
import numpy as np
import pytest
import torch

from hardway.formats.gguf import GGUFError, gguf_checkpoint, gguf_config

# Keys of our config that transformers' config object spells or keeps otherwise (the hub's config.json spelling kept
# beside transformers 5's rope_parameters; transformers leaves `architectures` empty for a GGUF).
NOT_IN_TRANSFORMERS = {"architectures", "rope_theta", "rope_local_base_freq", "sliding_window_pattern", "rope_scaling"}
# the hub's config.json name -> the name transformers 5's config object stores it under
TRANSFORMERS_NAMES = {"num_experts": "num_local_experts"}


def same_value(ours, theirs) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return theirs is not None and ours is not None and np.float32(ours) == np.float32(theirs)
    return ours == theirs


def compare(path, needed_keys, model=None):
    """Our config and checkpoint against transformers' model from the same file (`model`, read here when None): every
    key both have, equal; the keys the model class needs, present in both; the same tensor names, every tensor equal."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    theirs = model.config.to_dict()
    theirs.update({hub: theirs[name] for hub, name in TRANSFORMERS_NAMES.items() if name in theirs})
    ours = gguf_checkpoint(path)
    assert ours.config == gguf_config(path)
    for key in needed_keys:
        assert key in ours.config and key in theirs, key
    shared = [k for k in ours.config if k in theirs and k not in NOT_IN_TRANSFORMERS]
    different = {k: (ours.config[k], theirs[k]) for k in shared if not same_value(ours.config[k], theirs[k])}
    assert not different
    rope = theirs.get("rope_parameters") or {}
    if "rope_theta" in rope:  # one RoPE for every layer: transformers 5 keeps config.json's rope_theta in there
        assert same_value(ours.config["rope_theta"], rope["rope_theta"])
    state = {k: v for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert ours.tensors.keys() == state.keys(), sorted(ours.tensors.keys() ^ state.keys())[:5]
    unequal = [k for k in state if not torch.equal(ours.tensors[k], state[k])]
    assert not unequal, unequal[:5]
    return ours, theirs




def write_qwen3(path, moe: bool, arch: str | None = None, q8_0: bool = False):
    """A tiny random Qwen3 (or Qwen3-MoE) GGUF, tensor names and metadata keys as llama.cpp's converter writes them;
    arch="qwen2": Qwen2's instead (q/k/v biases, no q/k norms, head_dim = hidden / heads). q8_0: the layers'
    projections quantized to Q8_0, as llama-quantize writes them."""
    arch = arch or ("qwen3moe" if moe else "qwen3")
    hidden, heads, kv_heads, head_dim, ff, layers, vocab = 64, 2, 1, 128 if not moe else 32, 96, 2, 160
    if arch == "qwen2":
        head_dim = hidden // heads
    experts, expert_ff = 4, 768  # transformers reads no expert_feed_forward_length: its default, 768, must be the truth
    g = np.random.default_rng(3)

    def w(*shape):
        return g.normal(0, 0.05, size=shape).astype(np.float32)

    writer = gguf.GGUFWriter(path, arch=arch)

    def add_matrix(name, weight):
        if q8_0:
            weight = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)  # (out, bytes a row) uint8
            writer.add_tensor(name, weight, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, weight)

    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if arch != "qwen2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(151643)
    writer.add_eos_token_id(151645)
    if moe:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(expert_ff)
    writer.add_tensor("token_embd.weight", w(vocab, hidden))
    writer.add_tensor("output_norm.weight", 1 + w(hidden))
    if not moe:
        writer.add_tensor("output.weight", w(vocab, hidden))  # an untied head
    for i in range(layers):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", 1 + w(hidden))
        add_matrix(f"{blk}.attn_q.weight", w(heads * head_dim, hidden))
        add_matrix(f"{blk}.attn_k.weight", w(kv_heads * head_dim, hidden))
        add_matrix(f"{blk}.attn_v.weight", w(kv_heads * head_dim, hidden))
        add_matrix(f"{blk}.attn_output.weight", w(hidden, heads * head_dim))
        if arch == "qwen2":
            writer.add_tensor(f"{blk}.attn_q.bias", w(heads * head_dim))
            writer.add_tensor(f"{blk}.attn_k.bias", w(kv_heads * head_dim))
            writer.add_tensor(f"{blk}.attn_v.bias", w(kv_heads * head_dim))
        else:
            writer.add_tensor(f"{blk}.attn_q_norm.weight", 1 + w(head_dim))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", 1 + w(head_dim))
        writer.add_tensor(f"{blk}.ffn_norm.weight", 1 + w(hidden))
        if moe:
            writer.add_tensor(f"{blk}.ffn_gate_inp.weight", w(experts, hidden))
            writer.add_tensor(f"{blk}.ffn_gate_exps.weight", w(experts, expert_ff, hidden))
            writer.add_tensor(f"{blk}.ffn_up_exps.weight", w(experts, expert_ff, hidden))
            writer.add_tensor(f"{blk}.ffn_down_exps.weight", w(experts, hidden, expert_ff))
        else:
            add_matrix(f"{blk}.ffn_gate.weight", w(ff, hidden))
            add_matrix(f"{blk}.ffn_up.weight", w(ff, hidden))
            add_matrix(f"{blk}.ffn_down.weight", w(hidden, ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


QWEN3_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "rope_parameters", "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id"]


def test_a_qwen3_file_is_transformers_reading(tmp_path):
    ours, _ = compare(write_qwen3(tmp_path / "qwen3.gguf", moe=False), QWEN3_KEYS)
    assert ours.config["model_type"] == "qwen3" and ours.config["head_dim"] == 128
    assert not ours.config["tie_word_embeddings"] and "lm_head.weight" in ours.tensors


def test_a_qwen3_moe_file_is_transformers_reading(tmp_path):
    ours, _ = compare(write_qwen3(tmp_path / "qwen3moe.gguf", moe=True),
                      QWEN3_KEYS + ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"])
    assert ours.config["model_type"] == "qwen3_moe" and ours.config["head_dim"] == 32
    assert ours.tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * 768, 64)


def test_a_qwen2_file_is_transformers_reading_and_loads(tmp_path):
    """Qwen2 is our Llama with biases (lesson 09), so hardway.load builds it: the logits are transformers'."""
    import hardway
    from transformers import AutoModelForCausalLM

    path = write_qwen3(tmp_path / "qwen2.gguf", moe=False, arch="qwen2")
    ours, _ = compare(path, [k for k in QWEN3_KEYS if k not in ("head_dim", "attention_bias", "rope_parameters")])
    assert ours.config["model_type"] == "qwen2" and "model.layers.1.self_attn.v_proj.bias" in ours.tensors
    ids = torch.tensor([[1, 17, 42, 99, 3]])  # (1, 5)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        delta = (hardway.load(path)(ids) - reference(ids).logits).abs().max().item()
    assert delta < 1e-5, f"max |delta| {delta:.2e} of the logits"


def test_an_unknown_architecture_is_refused_in_one_line(tmp_path):
    import hardway

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(path, arch="mamba")
    writer.add_tensor("x", np.zeros(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError) as e:
        gguf_config(path)
    assert str(e.value) == (f"{path}: general.architecture is 'mamba'; supported: llama, qwen2, qwen3, qwen3moe, "
                            f"gemma3, qwen35, gpt-oss")
    with pytest.raises(GGUFError, match="general.architecture is 'mamba'"):
        hardway.load(path)
