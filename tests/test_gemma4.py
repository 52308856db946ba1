"""Lesson 30: Gemma 4's text model against transformers' Gemma4ForCausalLM, on random tiny configurations.

Three layouts (per-layer inputs and shared layers of both types; keys as values without either; everything at once),
every tensor random, a sliding window of 7 and prompts of 40 and more: logits within 1e-4, greedy tokens identical
with and without the cache and through lesson 12's static step, a left-padded batch equal to each row alone and to
transformers'. Then the cache (what it holds, at the published sizes on the meta device), both spellings of the
config, a `gemma4` checkpoint for images and text, and the configurations that are refused.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hardway.decode.generate import generate
from hardway.decode.static import StaticDecodeStep
from hardway.errors import ConfigError
from hardway.loading import load
from hardway.models.gemma4 import Gemma4
from hardway.models.gemma4_config import gemma4_config
from hardway.models.layer_shaped_cache import LayerShapedKVCache

transformers = pytest.importorskip("transformers")

S, F = "sliding_attention", "full_attention"
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=7, max_position_embeddings=512,
            final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LAYOUTS = {
    "per-layer inputs, shared layers of both types, wide MLPs": dict(
        layer_types=[S, S, F] * 2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=160,
        num_kv_shared_layers=3, use_double_wide_mlp=True),
    "keys as values, no per-layer inputs, no sharing": dict(
        num_hidden_layers=5, layer_types=[S] * 4 + [F], attention_k_eq_v=True, num_global_key_value_heads=1,
        hidden_size_per_layer_input=0, tie_word_embeddings=False),
    "everything": dict(layer_types=[F, S, S, F, S, F], attention_k_eq_v=True, num_global_key_value_heads=1,
                       hidden_size_per_layer_input=8, vocab_size_per_layer_input=160, num_kv_shared_layers=2),
}


def randomize(model):
    """Every tensor random, norms around 1 and layer scalars included (at their initial values a mistake in how one is
    applied would not show), then eval mode."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name else
                    0.15 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pair(request, tmp_path_factory):
    """(transformers' model, ours loaded from its save_pretrained folder, the folder)."""
    folder = tmp_path_factory.mktemp("gemma4")
    ref = randomize(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**TINY, **LAYOUTS[request.param]})))
    ref.save_pretrained(folder)
    return ref, load(folder), folder


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 160, (1, 40), generator=torch.Generator().manual_seed(2))  # (1, 40): past the window


def test_logits_and_greedy_tokens_equal_transformers(pair, ids):
    ref, ours, _ = pair
    assert type(ours) is Gemma4
    with torch.inference_mode():
        delta = (ours(ids) - ref(ids).logits).abs().max().item()
        expected = ref.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, min_new_tokens=20)
        assert delta <= 1e-4, delta
        assert torch.equal(generate(ours, ids, 20, eos_token_id=None), expected)
        assert torch.equal(generate(ours, ids, 6, eos_token_id=None, use_cache=False), expected[:, :46])
        if ours.config.attention_k_eq_v and ours.config.num_kv_shared_layers:  # one layout: dynamo takes seconds
            step = StaticDecodeStep(ours, max_len=64, backend="eager")  # lesson 12's static cache, shaped per layer
            assert torch.equal(step.generate(ids, 20, eos_token_id=None), expected)
            assert [tuple(k.shape[1::2]) for k in step.kv_cache.k] == step.kv_cache.layer_shapes


def test_a_prompt_in_pieces_equals_transformers_in_pieces_and_last_only_one_pass(pair, ids):
    """The cache across passes (against transformers' own cache, fed the same pieces: these random weights amplify
    fp32 rounding, so a pass in pieces and a whole pass differ by up to 1e-4 in both models), and the shortcut that
    runs the shared layers on the last position alone."""
    ref, ours, _ = pair
    pieces = ((0, 9), (9, 10), (10, 40))
    with torch.inference_mode():
        cache, theirs = ours.new_kv_cache(1, 40), transformers.DynamicCache(config=ref.config)
        ours_parts = torch.cat([ours(ids[:, a:b], kv_cache=cache, start_pos=a) for a, b in pieces], dim=1)
        their_parts = torch.cat([ref(ids[:, a:b], cache=theirs, use_cache=True).logits for a, b in pieces], dim=1)
        whole = ours(ids)  # (1, 40, V)
        last = ours(ids, kv_cache=ours.new_kv_cache(1, 40), last_only=True)  # (1, 1, V)
    assert (ours_parts - their_parts).abs().max() <= 1e-4
    assert (last[:, 0] - whole[:, -1]).abs().max() <= 1e-5


def test_a_left_padded_batch_equals_each_row_alone_and_transformers(pair, ids):
    ref, ours, _ = pair
    rows = [ids[0, :30], ids[0, 31:40]]  # 30 and 9 tokens
    batch, mask = torch.zeros(2, 30, dtype=torch.long), torch.zeros(2, 30, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, 30 - len(row):], mask[i, 30 - len(row):] = row, 1
    with torch.inference_mode():
        together = generate(ours, batch, 15, eos_token_id=None, attention_mask=mask)
        for i, row in enumerate(rows):
            assert torch.equal(together[i, 30:], generate(ours, row[None], 15, eos_token_id=None)[0, len(row):]), i
        theirs = ref.generate(batch, attention_mask=mask, max_new_tokens=15, do_sample=False, eos_token_id=None,
                              min_new_tokens=15)
        assert torch.equal(together, theirs)


def test_the_cache_holds_the_layers_before_the_shared_ones_each_in_its_shape(pair):
    ref, ours, _ = pair
    c = ref.config
    first = c.num_hidden_layers - c.num_kv_shared_layers
    cache = ours.new_kv_cache(2, 50)
    assert isinstance(cache, LayerShapedKVCache) and cache.n_layers == len(cache.k) == first
    for i in range(first):  # transformers' own layer: its key projection says the heads and the head size
        attn = ref.model.layers[i].self_attn
        assert cache.k[i].shape == cache.v[i].shape == (2, attn.k_proj.out_features // attn.head_dim, 50,
                                                        attn.head_dim), i
    for i in range(first, c.num_hidden_layers):  # a shared layer has no projection of its own, in either model
        assert not hasattr(ref.model.layers[i].self_attn, "k_proj") and not hasattr(ours.blocks[i].attn, "k_proj")
    values = sum(2 * k.shape[1] * k.shape[3] for k in cache.k)
    assert cache.bytes_per_token == 2 * values * 4 and cache.nbytes == 50 * cache.bytes_per_token
    assert ours.sliding_windows == tuple(7 if t == S else None for t in c.layer_types[:first])


def test_the_hubs_spelling_of_the_config_gives_the_same_model(pair, ids, tmp_path):
    """The hub's files name global_head_dim and num_global_key_value_heads; transformers 5 writes per_layer_config."""
    ref, ours, folder = pair
    d = json.loads((folder / "config.json").read_text())
    d.pop("per_layer_config")
    d["global_head_dim"], d["num_global_key_value_heads"] = 32, 1
    (tmp_path / "config.json").write_text(json.dumps(d))
    tensors = load_file(folder / "model.safetensors")
    for i in range(d["num_hidden_layers"] - d["num_kv_shared_layers"], d["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.zeros(32, 64)  # hub files may carry these
    save_file(tensors, tmp_path / "model.safetensors")
    with torch.inference_mode():
        assert torch.equal(load(tmp_path)(ids), ours(ids))


def test_a_gemma4_checkpoint_for_images_and_text_loads_its_text_model(tmp_path, ids):
    text = transformers.Gemma4TextConfig(**{**TINY, **LAYOUTS["everything"]})
    vision = transformers.models.gemma4.configuration_gemma4.Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       image_token_id=159, boi_token_id=158, eoi_token_id=157, video_token_id=156,
                                       boa_token_id=155, eoa_token_index=154, audio_token_id=153)
    ref = randomize(transformers.Gemma4ForConditionalGeneration(config))
    ref.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma4"
    ours = load(tmp_path)
    with torch.inference_mode():
        assert (ours(ids) - ref(input_ids=ids).logits).abs().max() <= 1e-4


PUBLISHED_E2B = {"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 1536, "intermediate_size": 6144,
                 "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
                 "global_head_dim": 512, "sliding_window": 512, "hidden_size_per_layer_input": 256,
                 "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "final_logit_softcapping": 30.0,
                 "layer_types": ([S] * 4 + [F]) * 7}


def test_e2b_at_its_published_size_on_the_meta_device():
    with torch.device("meta"):
        model = Gemma4(gemma4_config(PUBLISHED_E2B)).to(torch.bfloat16)
        cache = model.new_kv_cache(1, 1000)
    # layers 0..14 keep keys: 12 sliding (1 KV head of 256) and 3 full (1 of 512), a key and a value each, bf16
    assert cache.n_layers == 15 and cache.bytes_per_token == 2 * 2 * (12 * 256 + 3 * 512)
    assert cache.nbytes == 1000 * cache.bytes_per_token and all(k.is_meta for k in cache.k)
    assert model.config.kv_sources[15:] == (13, 13, 13, 13, 14) * 4
    assert model.blocks[15].mlp.gate_proj.out_features == 2 * 6144 and model.blocks[14].mlp.gate_proj.out_features == 6144
    assert model.per_layer_emb.weight.shape == (262144, 35 * 256)


@pytest.mark.parametrize("change, words", [
    ({"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2}, "enable_moe_block"),
    ({"rope_parameters": {F: {"rope_type": "yarn", "factor": 4.0}, S: {"rope_type": "default"}}}, "'yarn'"),
    ({"rope_parameters": {F: {"rope_type": "proportional", "factor": 8.0}, S: {}}}, "factor"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"layer_types": [F, F, S, S, S, F], "num_kv_shared_layers": 4}, "no sliding_attention layer"),
    ({"num_kv_shared_layers": 6}, "num_kv_shared_layers"),
    ({"layer_types": [S, "chunked_attention", S, S, S, F]}, "layer_types"),
    ({"per_layer_config": {"1": {"sliding_window": 3}}}, "per_layer_config"),
    ({"per_layer_config": {"5": {"head_dim": 64}}, "global_head_dim": None}, "different head sizes"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"vocab_size_per_layer_input": 100, "hidden_size_per_layer_input": 8}, "vocab_size_per_layer_input"),
    ({"model_type": "gemma3_text"}, "model_type"),
])
def test_what_is_not_implemented_is_one_line_naming_it(change, words):
    d = {"model_type": "gemma4_text", **{k: v for k, v in TINY.items() if not k.endswith("token_id")},
         "layer_types": [S, S, F] * 2, **change}
    if "per_layer_config" in change:
        d["per_layer_config"] = {**{"2": {"head_dim": 32}}, **change["per_layer_config"]}
    with pytest.raises(ConfigError) as e:
        gemma4_config(d)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_load_refuses_the_26b_a4b_experts_in_one_line(tmp_path):
    d = {"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", **TINY, "enable_moe_block": True}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    save_file({"lm_head.weight": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="enable_moe_block"):
        load(tmp_path)


def test_an_int8_cache_is_refused_with_the_reason(pair, ids):
    _, ours, _ = pair
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        generate(ours, ids, 2, kv_cache_dtype="int8")
