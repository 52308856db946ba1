"""hardway.models.llama against transformers' LlamaForCausalLM / Qwen2ForCausalLM.

Tiny seeded random models (2 layers, hidden 64, 4 query / 2 key-value heads) cover every variant the course serves:
plain Llama (SmolLM2), head_dim != hidden/heads, attention biases, Llama 3's rope scaling with a small
original_max_position_embeddings so the rescaling changes the frequencies, Qwen2 (q/k/v biases, rope_theta 1e6),
tied and untied heads, single-file and sharded saves, and config.json in the hub's spelling. Then SmolLM2-135M's
real weights (the offline stand-in) in fp32 and bf16.
"""

import json

import pytest
import torch
from safetensors.torch import load_file as st_load, save_file as st_save
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hardway.decode.generate import generate
from hardway.formats.hub import checkpoint
from hardway.errors import CheckpointError, ConfigError
from hardway.loading import eos_token_list, load, read_checkpoint
from hardway.models.llama import Llama, ModelConfig, hub_to_hardway_names, rope_inv_freq

def config_of(folder) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((folder / "config.json").read_text(encoding="utf-8")))


TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(head_dim=16, tie_word_embeddings=False)),
    "llama-head_dim-32-tied": (LlamaConfig, LlamaForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    "llama-biases": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "llama3-rope-tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2-tied": (Qwen2Config, Qwen2ForCausalLM,
                   dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
MAX_DELTA = 1e-4


def make_checkpoint(case, save, folder, seed=0):
    """Save a seeded random transformers model of `case` into `folder`, as `save` says."""
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**TINY, **extra)).eval()
    with torch.no_grad():  # the default init leaves norms at 1 and biases at 0: make every tensor matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(folder, max_shard_size="40KB" if save == "sharded" else "5GB")
    if save == "sharded":
        assert (folder / "model.safetensors.index.json").exists() and not (folder / "model.safetensors").exists()
    if save == "hub-spelling":  # rewrite config.json the way the hub's files spell it (rope_theta + rope_scaling)
        cfg = json.loads((folder / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        cfg["torch_dtype"] = cfg.pop("dtype", "float32")
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def reference(folder, dtype=torch.float32):
    """transformers' model, loaded from the same files."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_greedy(hf, ids, n_new, eos=True):
    if not eos:  # random models: a fixed number of tokens, no early stop
        hf.generation_config.eos_token_id = None
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                       pad_token_id=0)


# every case saved as one file; sharded and hub-spelling saves on three representative cases
LOGIT_CASES = [(case, "single") for case in CASES] + [
    (case, save) for save in ("sharded", "hub-spelling") for case in ("llama", "llama3-rope-tied", "qwen2-tied")]


@pytest.mark.parametrize("case, save", LOGIT_CASES)
def test_logits_match_transformers_fp32(case, save, tmp_path):
    folder = make_checkpoint(case, save, tmp_path)
    hf, model = reference(folder), load(folder, "cpu", torch.float32)
    ids = torch.randint(0, TINY["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))  # (B, T)
    with torch.inference_mode():
        delta = (model(ids) - hf(ids).logits).abs().max().item()
    print(f"{case}/{save}: fp32 max |Δ logits| = {delta:.3g}")
    assert delta <= MAX_DELTA, f"{case}/{save}: max |Δ logits| = {delta}"


@pytest.mark.parametrize("case", CASES)
def test_20_greedy_tokens_match_transformers(case, tmp_path):
    folder = make_checkpoint(case, "single", tmp_path)
    hf, model = reference(folder), load(folder)
    ids = torch.randint(0, TINY["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours = generate(model, ids, max_new_tokens=20, eos_token_id=None)
        theirs = hf_greedy(hf, ids, 20, eos=False)
    assert theirs.shape[1] == 27
    assert ours.tolist() == theirs.tolist()


@pytest.mark.parametrize("case", ["llama", "qwen2-tied"])
def test_cache_paths_agree_with_the_full_forward(case, tmp_path):
    """Prefill + one-token steps, and a chunked prefill (T > 1 at start_pos > 0), give the full forward's logits."""
    model = load(make_checkpoint(case, "single", tmp_path))
    ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(ids)  # (B, 20, vocab)
        cache = model.new_kv_cache(2, 20)
        chunks = [model(ids[:, :8], cache, 0), model(ids[:, 8:13], cache, 8)]  # prefill, then a chunk of 5
        chunks += [model(ids[:, t:t + 1], cache, t) for t in range(13, 20)]  # then one token at a time
        stepped = torch.cat(chunks, dim=1)
    assert (stepped - full).abs().max().item() <= MAX_DELTA


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_hardway_load_dispatches_llama_and_qwen2(case, tmp_path):
    folder = make_checkpoint(case, "single", tmp_path)
    model = load(folder, dtype=torch.float32)
    assert isinstance(model, Llama) and model.config.model_type == case
    assert model.config.attention_bias == (case == "qwen2")


def test_llama3_scaling_changes_the_frequencies_and_matches_transformers(tmp_path):
    folder = make_checkpoint("llama3-rope-tied", "single", tmp_path)
    model, hf = load(folder), reference(folder)
    plain = config_of(folder)
    plain.rope_scaling = None
    assert not torch.equal(model.rope.inv_freq, rope_inv_freq(plain))  # the test config makes scaling bite
    assert torch.equal(model.rope.inv_freq, hf.model.rotary_emb.inv_freq)  # bit-equal to transformers'
    assert model.rope.inv_freq.dtype == torch.float32


def test_config_spellings_and_defaults():
    hub = {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rope_theta": 5e5,
           "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}, "torch_dtype": "bfloat16",
           "eos_token_id": [5, 6]}
    ours_5 = {**{k: v for k, v in hub.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")},
              "rope_parameters": dict(LLAMA3_ROPE), "dtype": "bfloat16"}
    a, b = ModelConfig.from_dict(hub), ModelConfig.from_dict(ours_5)
    assert a == b
    assert a.rope_theta == 5e5 and a.rope_scaling["rope_type"] == "llama3" and a.dtype == "bfloat16"
    assert a.head_dim == 16
    qwen = ModelConfig.from_dict({**hub, "model_type": "qwen2", "rope_scaling": None, "eos_token_id": 7})
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.rope_scaling is None


def test_eos_ids_are_one_list_whatever_the_file_writes():
    assert eos_token_list(None) == [] and eos_token_list(7) == [7] and eos_token_list([5, 6]) == [5, 6]


def test_eos_from_config_json_without_generation_config(tmp_path):
    folder = make_checkpoint("llama", "single", tmp_path)
    (folder / "generation_config.json").unlink(missing_ok=True)
    assert read_checkpoint(folder).eos_token_ids == [2] == load(folder).eos_token_ids


def test_eos_from_generation_config_like_transformers(tmp_path):
    folder = make_checkpoint("llama", "single", tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 9]}))
    assert load(folder).eos_token_ids == reference(folder).generation_config.eos_token_id == [2, 9]


def test_tied_head_is_the_embedding_and_dtype_is_applied(tmp_path):
    folder = make_checkpoint("llama3-rope-tied", "single", tmp_path)
    model = load(folder, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.inv_freq.dtype == torch.float32
    assert model.max_seq_len == TINY["max_position_embeddings"] and model.eos_token_ids == [2]
    cache = model.new_kv_cache(1, 10)
    assert cache.k.dtype == torch.bfloat16 and cache.k.shape == (2, 1, 2, 10, 16)
    untied = load(make_checkpoint("llama", "single", tmp_path / "untied"))
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_weight_name_map_covers_the_transformers_state_dict(tmp_path):
    for case, (config_cls, model_cls, extra) in CASES.items():
        folder = make_checkpoint(case, "single", tmp_path / case)
        on_disk = set(st_load(folder / "model.safetensors"))
        assert set(hub_to_hardway_names(config_of(folder))) == on_disk, case


def _rewrite(folder, edit):
    tensors = st_load(folder / "model.safetensors")
    edit(tensors)
    st_save(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_shape_mismatch_names_the_tensor(tmp_path):
    folder = make_checkpoint("llama", "single", tmp_path)
    _rewrite(folder, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(48, 64)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(48, 64\).*\(32, 64\)"):
        load(folder)


def test_missing_tensor_is_named(tmp_path):
    folder = make_checkpoint("llama", "single", tmp_path)
    _rewrite(folder, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.0\.mlp\.up_proj\.weight"):
        load(folder)


def test_unexpected_tensor_is_named(tmp_path):
    folder = make_checkpoint("llama", "single", tmp_path)
    _rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.self_attn\.q_norm\.weight"):
        load(folder)


@pytest.mark.parametrize("change, problem", [
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"rope_scaling": {"rope_type": "xpos", "factor": 4.0}}, "rope_type 'xpos'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_configs_are_refused_clearly(change, problem, tmp_path):
    folder = make_checkpoint("llama", "single", tmp_path)
    cfg = {**json.loads((folder / "config.json").read_text()), **change}
    if "rope_scaling" in change:  # rope_parameters would take precedence over the hub spelling
        cfg.pop("rope_parameters")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=problem):
        load(folder)


# --- SmolLM2-135M-Instruct, real weights (offline stand-in) ---------------------------------------------------------

PROMPT = "<|im_start|>user\nWrite a short story about the sea.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2():
    folder = checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    ids = torch.tensor([Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids])
    return folder, ids


def test_smollm2_fp32_logits_match_transformers(smollm2):
    folder, ids = smollm2
    model, hf = load(folder, dtype=torch.float32), reference(folder, torch.float32)
    with torch.inference_mode():
        delta = (model(ids) - hf(ids).logits).abs().max().item()
    print(f"SmolLM2-135M fp32: max |Δ logits| = {delta:.3g}")
    assert delta <= MAX_DELTA


def test_smollm2_bf16_50_greedy_tokens_match_transformers(smollm2):
    folder, ids = smollm2
    model, hf = load(folder, dtype=torch.bfloat16), reference(folder, torch.bfloat16)
    assert hf.dtype == torch.bfloat16
    with torch.inference_mode():
        theirs = hf_greedy(hf, ids, 50, eos=False)  # exactly 50 new tokens
        ours = generate(model, ids, max_new_tokens=50, eos_token_id=None)
    assert theirs.shape[1] == ids.shape[1] + 50
    n_same = next((i for i, (a, b) in enumerate(zip(ours[0].tolist(), theirs[0].tolist())) if a != b),
                  min(ours.shape[1], theirs.shape[1]))
    assert ours.tolist() == theirs.tolist(), f"first difference at position {n_same} of {theirs.shape[1]}"
