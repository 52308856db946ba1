"""hardway.models.gpt2 against transformers' GPT2LMHeadModel on the same files, the cached forward, and loading errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from hardway.errors import CheckpointError, ConfigError
from hardway.models.gpt2 import GPT, GPT2Config, gelu_tanh
from hardway.formats.hub import checkpoint
from hardway.loading import MODEL_CLASSES, forward_once, load, resolve

TOL = 1e-4  # fp32 max |Δ logits| target from the course brief


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A seeded random 2-layer GPT-2 saved with transformers' save_pretrained (`transformer.` prefix)."""
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    config = HFGPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=100,
                          bos_token_id=99, eos_token_id=99)
    reference = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # make the weights larger than the 0.02-std init, so the logits are not all ~0
        for p in reference.parameters():
            p.mul_(5.0)
    reference.save_pretrained(folder)
    return folder, reference


def copy_checkpoint(folder, dest, edit=None, config_edit=None):
    """A copy of a checkpoint folder whose tensors (and config.json) were changed by edit / config_edit."""
    shutil.copytree(folder, dest)
    if edit is not None:
        tensors = st_load_file(dest / "model.safetensors")
        edit(tensors)
        st_save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    if config_edit is not None:
        cfg = json.loads((dest / "config.json").read_text())
        config_edit(cfg)
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_the_model_table_names_gpt():
    assert resolve(MODEL_CLASSES["gpt2"]) is GPT


def test_standin_logits_match_transformers():
    """The 124M stand-in, hub spelling (no prefix, h.N.attn.bias buffers, no lm_head.weight)."""
    model = load("openai-community/gpt2")
    assert model.max_seq_len == 1024 and model.eos_token_ids == [50256]
    reference = GPT2LMHeadModel.from_pretrained(checkpoint("openai-community/gpt2"), dtype=torch.float32).eval()
    ids = torch.tensor([[15496, 11, 616, 1438, 318, 1757, 290, 314]])  # "Hello, my name is John and I"
    ours = forward_once(model, ids)
    with torch.inference_mode():
        theirs = reference(ids).logits
    assert ours.shape == theirs.shape == (1, 8, 50257)
    delta = (ours - theirs).abs().max().item()
    assert delta <= TOL, f"max |Δ logits| = {delta:.3e}"


def test_tiny_save_pretrained_spelling_matches_transformers(tiny):
    folder, reference = tiny
    model = load(folder)
    assert isinstance(model, GPT)
    assert model.config == GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                      eos_token_ids=[99])
    ids = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    ours = forward_once(model, ids)
    with torch.inference_mode():
        theirs = reference(ids).logits
    assert theirs.abs().max() > 1.0  # a comparison of near-zero logits would prove little
    delta = (ours - theirs).abs().max().item()
    assert delta <= TOL, f"max |Δ logits| = {delta:.3e}"


def test_sharded_checkpoint(tiny, tmp_path):
    """save_pretrained with a small max_shard_size writes model.safetensors.index.json + shards."""
    folder, reference = tiny
    reference.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        assert (forward_once(load(tmp_path), ids) - reference(ids).logits).abs().max() <= TOL


def test_head_is_tied_not_copied(tiny):
    model = load(tiny[0])
    names = [name for name, _ in model.named_parameters()]
    assert not any("lm_head" in n for n in names)
    with torch.no_grad():
        model.wte.weight[5].zero_()
    logits = forward_once(model, torch.tensor([[1, 2, 3]]))
    assert torch.all(logits[..., 5] == 0)  # the head reads the (changed) embedding itself


def test_lm_head_weight_in_file_is_accepted_when_tied(tiny, tmp_path):
    folder, reference = tiny

    def add_lm_head(t):
        t["lm_head.weight"] = t["transformer.wte.weight"].clone()

    model = load(copy_checkpoint(folder, tmp_path / "with-head", add_lm_head))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        assert (forward_once(model, ids) - reference(ids).logits).abs().max() <= TOL

    def add_untied_head(t):
        t["lm_head.weight"] = t["transformer.wte.weight"] + 1.0

    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load(copy_checkpoint(folder, tmp_path / "untied", add_untied_head))


class FakeCache:
    """The smallest object with KVCache's update(): preallocated per-layer k/v, written in place."""

    def __init__(self, n_layers, batch, heads, max_len, head_dim):
        self.k = torch.zeros(n_layers, batch, heads, max_len, head_dim)
        self.v = torch.zeros(n_layers, batch, heads, max_len, head_dim)

    def update(self, layer_idx, start_pos, k, v):
        end = start_pos + k.shape[2]
        self.k[layer_idx, :, :, start_pos:end] = k
        self.v[layer_idx, :, :, start_pos:end] = v
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]


def cached_forward(model, ids, cache, chunks):
    """Feed ids through the cache in chunks of the given sizes; return the concatenated logits."""
    out, pos = [], 0
    with torch.inference_mode():
        for n in chunks:
            out.append(model(ids[:, pos:pos + n], kv_cache=cache, start_pos=pos))
            pos += n
    return torch.cat(out, dim=1)


def test_cached_forward_equals_uncached(tiny):
    model = load(tiny[0])
    c = model.config
    ids = torch.randint(0, 100, (2, 14), generator=torch.Generator().manual_seed(2))
    full = forward_once(model, ids)  # (2, 14, V)
    # prefill 5, a chunk of 3 at start_pos 5 (a causal mask offset by the cache), then single tokens
    chunks = [5, 3] + [1] * 6
    # Same fp32 target as against transformers: only the matmul shapes (hence the rounding) differ.
    fake = cached_forward(model, ids, FakeCache(c.n_layer, 2, c.n_head, 20, c.head_dim), chunks)
    assert (fake - full).abs().max() <= TOL
    assert torch.equal(fake.argmax(-1), full.argmax(-1))
    real = cached_forward(model, ids, model.new_kv_cache(2, 20), chunks)  # hardway.models.kv_cache.KVCache
    assert (real - full).abs().max() <= TOL


def test_new_kv_cache_matches_the_model(tiny):
    model = load(tiny[0])
    cache = model.new_kv_cache(3, 10)
    assert tuple(cache.k.shape) == (2, 3, 4, 10, 16) and cache.k.dtype == torch.float32
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model.new_kv_cache(1, 33)
    assert model.new_kv_cache(1).max_len == model.max_seq_len == 32  # max_len defaults to the whole context


def test_context_overflow_is_a_clear_error(tiny):
    model = load(tiny[0])
    with pytest.raises(ValueError, match="n_positions=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="n_positions=32"):
        model(torch.zeros(1, 2, dtype=torch.long), start_pos=31)
    assert model(torch.zeros(1, 1, dtype=torch.long), start_pos=31).shape == (1, 1, 100)  # the last position fits


def test_unknown_model_type(tiny, tmp_path):
    folder = copy_checkpoint(tiny[0], tmp_path / "bert", config_edit=lambda cfg: cfg.update(model_type="bert"))
    with pytest.raises(ConfigError, match=r"'bert'.*supported.*'gpt2'"):
        load(folder)


def test_missing_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(tmp_path)


def test_unsupported_config_setting(tiny, tmp_path):
    folder = copy_checkpoint(tiny[0], tmp_path / "relu", config_edit=lambda cfg: cfg.update(activation_function="relu"))
    with pytest.raises(ConfigError, match="activation_function"):
        load(folder)


def test_wrong_shape_names_the_tensor(tiny, tmp_path):
    def shrink(t):
        t["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(64, 200)

    with pytest.raises(CheckpointError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight.*\[64, 200\].*\[64, 256\]"):
        load(copy_checkpoint(tiny[0], tmp_path / "shape", shrink))


def test_missing_tensor_is_named(tiny, tmp_path):
    with pytest.raises(CheckpointError, match=r"missing.*h\.0\.ln_2\.bias"):
        load(copy_checkpoint(tiny[0], tmp_path / "missing", lambda t: t.pop("transformer.h.0.ln_2.bias")))


def test_unexpected_tensor_is_named(tiny, tmp_path):
    def extra(t):
        t["transformer.h.0.attn.rotary_emb.inv_freq"] = torch.zeros(8)

    with pytest.raises(CheckpointError, match=r"unexpected.*rotary_emb\.inv_freq"):
        load(copy_checkpoint(tiny[0], tmp_path / "extra", extra))


def test_gelu_is_gpt2s_tanh_gelu():
    from transformers.activations import ACT2FN

    x = torch.linspace(-8, 8, 10_001)
    assert (gelu_tanh(x) - ACT2FN["gelu_new"](x)).abs().max() <= 1e-6
    assert (gelu_tanh(x) - torch.nn.functional.gelu(x)).abs().max() > 1e-4  # not the exact (erf) GELU
