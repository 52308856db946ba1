"""hardway.models.gemma3 against transformers' Gemma3ForCausalLM, on tiny seeded random models whose sliding window
(8 positions) is far shorter than the prompts (30 tokens), so every sliding layer masks keys out of its window:
logits, greedy tokens, the KV cache, left-padded batches, lesson 12's static cache and the engine's paged cache,
both spellings of config.json. Then the real Gemma 3 270M file, once lesson 16 reads it."""

import json
import shutil

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from transformers.masking_utils import sliding_window_causal_mask_function

from hardway.decode.generate import generate
from hardway.decode.static import StaticDecodeStep
from hardway.engine.paged_cache import PagedKVCache
from hardway.errors import ConfigError
from hardway.loading import load
from hardway.models.gemma3 import Gemma3Config, sliding_window_mask
from hardway.verify.ritual import attention_diffs

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
# fp32 rounding: the same SDPA calls as transformers give 0.0 here (measured); 1e-5 leaves room for another kernel
# order on another CPU, and a real mistake (a window off by one, w for 1 + w) is far above it (lesson 20).
MAX_DELTA = 1e-5


def make_checkpoint(folder, seed=0, hub_spelling=False, **extra):
    """A seeded random Gemma 3 saved by transformers into `folder`; the transformers model, in eval mode."""
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**TINY, **extra})).eval()
    with torch.no_grad():  # the default init leaves the norms' weights at 0: make every tensor matter
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder)
    if hub_spelling:  # config.json as the hub's files spell it: rope_theta + rope_local_base_freq, a window pattern
        cfg = json.loads((folder / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"], cfg["rope_local_base_freq"] = (rope["full_attention"]["rope_theta"],
                                                          rope["sliding_attention"]["rope_theta"])
        cfg["rope_scaling"] = None
        cfg.pop("layer_types")
        cfg["sliding_window_pattern"] = 3  # layers 0, 1 sliding, 2 full, 3 sliding: LAYER_TYPES
        (folder / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    theirs = make_checkpoint(folder)
    return load(folder), theirs


def prompt(n=30, seed=1):
    return torch.randint(3, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def test_the_mask_is_transformers_sliding_window_mask():
    for T, S, start in ((12, 12, 0), (1, 20, 19), (3, 20, 17)):
        ours = sliding_window_mask(T, S, WINDOW, start_pos=start)
        rule = sliding_window_causal_mask_function(WINDOW)
        theirs = torch.tensor([[bool(rule(0, 0, torch.tensor(start + t), torch.tensor(s))) for s in range(S)] for t in range(T)])
        assert torch.equal(ours, theirs), (T, S, start)
    assert sliding_window_mask(12, 12, WINDOW)[11].sum() == WINDOW  # a query sees itself and the W - 1 before it


@pytest.mark.parametrize("spelling", ["transformers-5", "hub"])
def test_logits_and_greedy_tokens_equal_transformers(spelling, tmp_path):
    theirs = make_checkpoint(tmp_path, hub_spelling=spelling == "hub")
    ours = load(tmp_path)
    assert ours.sliding_windows == (WINDOW, WINDOW, None, WINDOW)
    ids = prompt()
    with torch.inference_mode():
        delta = (ours(ids) - theirs(ids).logits).abs().max().item()
    assert delta <= MAX_DELTA, delta
    expected = theirs.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, min_new_tokens=40)
    assert torch.equal(generate(ours, ids, 40, eos_token_id=None), expected)  # the KV cache, past the window


def test_final_logit_soft_capping_and_an_untied_head(tmp_path):
    theirs = make_checkpoint(tmp_path, final_logit_softcapping=3.0, tie_word_embeddings=False)
    ours = load(tmp_path)
    ids = prompt()
    with torch.inference_mode():
        ref = theirs(ids).logits
        delta = (ours(ids) - ref).abs().max().item()
    assert ref.abs().max() < 3.0 and delta <= MAX_DELTA, delta


def test_cached_generation_equals_recomputing_everything(pair):
    ours, _ = pair
    ids = prompt(seed=2)
    cached = generate(ours, ids, 32, eos_token_id=None)
    assert torch.equal(cached, generate(ours, ids, 32, eos_token_id=None, use_cache=False))


def test_a_left_padded_batch_equals_each_row_alone(pair):
    ours, theirs = pair
    rows = [prompt(30, seed=3)[0], prompt(19, seed=4)[0], prompt(5, seed=5)[0]]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):], mask[i, T - len(r):] = r, 1
    with torch.inference_mode():
        batch = ours(ids, attention_mask=mask)  # (3, T, V)
        for i, r in enumerate(rows):
            delta = (batch[i, T - len(r):] - ours(r[None])[0]).abs().max().item()
            assert delta <= MAX_DELTA, (i, delta)
    out = generate(ours, ids, 24, eos_token_id=None, attention_mask=mask)
    for i, r in enumerate(rows):
        assert torch.equal(out[i, T:], generate(ours, r[None], 24, eos_token_id=None)[0, len(r):]), i


def test_a_sliding_layer_ignores_whatever_the_cache_holds_outside_its_window(pair):
    """The interface the engine's sliding-window cache relies on: keys in columns the window hides may be garbage."""
    ours, _ = pair
    ids = prompt(seed=6)
    with torch.inference_mode():
        cache = ours.new_kv_cache(1, 40)
        ours(ids, kv_cache=cache)
        clean = ours(torch.tensor([[7]]), kv_cache=cache, start_pos=30)
        for layer, window in enumerate(ours.sliding_windows):
            if window is not None:  # position 30 sees 23..30: overwrite 0..22
                cache.k[layer, :, :, :30 - window + 1].normal_(0, 100)
                cache.v[layer, :, :, :30 - window + 1].normal_(0, 100)
        assert torch.equal(ours(torch.tensor([[7]]), kv_cache=cache, start_pos=30), clean)


def test_the_static_cache_step_gives_the_eager_tokens(pair):
    ours, _ = pair
    ids = prompt(seed=7)
    step = StaticDecodeStep(ours, max_len=64, backend="eager")  # the compiled path's cache and masks, traced
    assert torch.equal(step.generate(ids, 30, eos_token_id=None), generate(ours, ids, 30, eos_token_id=None))


def test_the_paged_cache_gives_the_tokens_of_each_row_alone(pair):
    """The engine's path: prompts prefilled one by one into a PagedKVCache, then decoded together, the shorter one
    left-padded in the gathered columns."""
    ours, _ = pair
    rows = [prompt(30, seed=8)[0].tolist(), prompt(13, seed=9)[0].tolist()]
    n_new = 20
    cache = PagedKVCache.for_model(ours, n_blocks=32, block_size=4)
    slots = [torch.arange(64) + 64 * i for i in range(len(rows))]  # each row its own 16 blocks, in order
    seqs = [list(r) for r in rows]
    with torch.inference_mode():
        for i, r in enumerate(rows):  # prefill, one row at a time
            cache.bind([slots[i][:len(r)]], [len(r)])
            logits = ours(torch.tensor([r]), kv_cache=cache, start_pos=0, last_only=True)
            seqs[i].append(int(logits[0, -1].argmax()))
        for _ in range(n_new - 1):  # decode, both rows in one pass
            mask = cache.bind([slots[i][:len(s)] for i, s in enumerate(seqs)], [1, 1])  # (2, S): row 1 padded
            S = cache.n_positions
            logits = ours(torch.tensor([[s[-1]] for s in seqs]), kv_cache=cache, start_pos=S - 1, attention_mask=mask)
            for i, s in enumerate(seqs):
                s.append(int(logits[i, -1].argmax()))
    for r, s in zip(rows, seqs):
        assert s == generate(ours, torch.tensor([r]), n_new, eos_token_id=None)[0].tolist()


def test_config_refusals(tmp_path):
    base = json.loads(Gemma3TextConfig(**TINY).to_json_string())
    for change, match in ((dict(hidden_activation="silu"), "hidden_activation"),
                          (dict(use_bidirectional_attention=True), "bidirectional"),
                          (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
                          (dict(layer_types=["full_attention"]), "layer_types"),
                          (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                           "yarn")):
        with pytest.raises(ConfigError, match=match):
            Gemma3Config.from_dict({**base, **change})


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="inductor's CPU code needs a C++ compiler")
def test_the_compiled_cpu_step_is_one_graph_with_eager_tokens(tmp_path, monkeypatch):
    """hardway.generate's default on CPU in fp32: lesson 12's compiled step, on weights laid out for it. One graph for
    a prompt shorter than the window and one longer (the window's mask is computed from the position tensor)."""
    from torch._dynamo.utils import counters

    make_checkpoint(tmp_path)
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.delenv("HARDWAY_EAGER", raising=False)
    model = load(tmp_path)
    monkeypatch.setenv("HARDWAY_EAGER", "1")
    eager_model = load(tmp_path)
    step = StaticDecodeStep(model, max_len=30 + 10)  # CPU: compiled_step's cpu backend, as fast_generate's
    for T in (5, 30):
        ids = prompt(T, seed=10 + T)
        assert torch.equal(step.generate(ids, 10, eos_token_id=None), generate(eager_model, ids, 10, eos_token_id=None))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_the_diagnostics_see_transformers_windows(pair):
    """Lesson 11's attention_diffs records transformers' q, k, v through an attention function of its own; the masks
    transformers builds for it must be SDPA's, or its sliding layers attend to everything and a full layer after
    them gets other inputs."""
    ours, theirs = pair
    first_full = ours.sliding_windows.index(None)
    assert max(attention_diffs(ours, theirs, prompt(), layer=first_full).values()) <= MAX_DELTA


def write_gguf(path, model):
    """`model` as llama.cpp's converter writes a Gemma 3 GGUF: its metadata keys (no query_pre_attn_scalar: the
    converter writes none), blk.N.* names, every norm stored as 1 + w, the head tied to the embeddings."""
    import gguf

    from hardway.formats.gguf_archs import ARCHITECTURES, GLOBAL_NAMES

    c = model.config
    writer = gguf.GGUFWriter(path, arch="gemma3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    to_gguf = {hub: g for g, hub in GLOBAL_NAMES.items()}
    to_gguf.update({f"model.layers.{i}.{hub}": f"blk.{i}.{g}" for i in range(c.num_hidden_layers)
                    for g, hub in ARCHITECTURES["gemma3"].layer_names.items()})
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: the file has no output.weight
        stem = name.removesuffix(".weight")
        w = tensor.float().numpy()
        writer.add_tensor(f"{to_gguf[stem]}.weight", w + 1 if stem.endswith("norm") else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_query_scale_is_query_pre_attn_scalar_not_head_dim(tmp_path):
    """Lessons 16 and 20: Gemma 3 scales queries by query_pre_attn_scalar^-1/2, which is not head_dim for every size
    (Gemma 3 27B: 168 = 5376 / 32 heads, head_dim 128). From config.json it is read as written; a GGUF stores none,
    so it is llama.cpp's rule: hidden_size / heads for the 62-block 27B, head_dim otherwise. Each against transformers'
    logits, on tiny models whose query_pre_attn_scalar differs from head_dim (32)."""
    from transformers import Gemma3TextConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from hardway.formats.gguf import gguf_config

    # config.json: TINY's 24, not head_dim's 32, and the logits show it (head_dim's scale would be far off)
    theirs = make_checkpoint(tmp_path / "config")
    ours = load(tmp_path / "config")
    ids = prompt()
    with torch.inference_mode():
        ref = theirs(ids).logits
        assert (ours(ids) - ref).abs().max().item() <= MAX_DELTA
        assert all(block.attn.scale == 24 ** -0.5 for block in ours.blocks)
        for block in ours.blocks:
            block.attn.scale = TINY["head_dim"] ** -0.5  # the assumption the lessons warn against
        assert (ours(ids) - ref).abs().max().item() > 1e-2

    def gguf_layout(n):  # what a GGUF implies: five sliding layers, then a full one (Gemma 3's pattern)
        return dict(num_hidden_layers=n, layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention"
                                                      for i in range(n)])

    # a GGUF of the 27B's shape: 62 blocks, query_pre_attn_scalar = C / heads = 64 / 4 = 16, head_dim 32
    theirs = make_checkpoint(tmp_path / "hf62", **gguf_layout(62), query_pre_attn_scalar=16)
    path = write_gguf(tmp_path / "gemma3-62.gguf", theirs)
    assert gguf_config(path)["query_pre_attn_scalar"] == 16 != TINY["head_dim"]
    ours = load(path)
    with torch.inference_mode():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= MAX_DELTA

    # any other block count: head_dim, the value of every other size
    theirs = make_checkpoint(tmp_path / "hf6", **gguf_layout(6), query_pre_attn_scalar=TINY["head_dim"])
    path = write_gguf(tmp_path / "gemma3-6.gguf", theirs)
    assert gguf_config(path)["query_pre_attn_scalar"] == TINY["head_dim"]
    with torch.inference_mode():
        assert (load(path)(ids) - theirs(ids).logits).abs().max().item() <= MAX_DELTA

    # transformers' GGUF reader maps no key to it, so its config keeps the class default (lesson 16 says so)
    assert "query_pre_attn_scalar" not in GGUF_CONFIG_MAPPING["gemma3"].values()
    assert Gemma3TextConfig().query_pre_attn_scalar == 256
