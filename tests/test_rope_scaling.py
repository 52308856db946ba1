"""Lesson 23's RoPE scaling (hardway/models/rope_scaling.py) against transformers 5: every rope_type on every RoPE
architecture the course loads, on tiny seeded random checkpoints written by save_pretrained, with prompts longer than
the length the model was "trained" at (original_max_position_embeddings = 32). The inverse frequencies and attention
factors against transformers' ROPE_INIT_FUNCTIONS; logits and greedy tokens against the model, with and without a
KV cache (dynamic and longrope change with the length, so the two differ, in transformers as here); malformed
parameters are one ConfigError naming the key; `hardway verify` passes on a checkpoint of each type."""

import json
import shutil

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hardway import cli
from hardway.decode.generate import generate
from hardway.decode.static import StaticDecodeStep
from hardway.errors import ConfigError
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.models.gemma3 import Gemma3, Gemma3Config
from hardway.models.llama import ModelConfig
from hardway.models.rope_scaling import ROPE_TYPES, rope_parameters

default_init = LlamaRotaryEmbedding.compute_default_rope_parameters  # "default" is not in ROPE_INIT_FUNCTIONS
HEAD_DIM = 16
TRAINED = 32  # the "trained" length every scaling stretches
SCALINGS = {  # rope_type -> its parameters (theta apart); each stretches 32 positions to 128
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},  # its config's max_position_embeddings is the trained length
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": TRAINED,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.6 * i for i in range(HEAD_DIM // 2)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": TRAINED},
}
VARIANTS = {  # variants of yarn transformers computes differently: DeepSeek's mscale pair, no truncation, betas
    "yarn-mscale-untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED,
                                "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
                                "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 3, "original_max_position_embeddings": TRAINED,
                              "attention_factor": 1.3},
    "longrope-factor": {**SCALINGS["longrope"], "factor": 6.0, "attention_factor": 1.1},
}
SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=HEAD_DIM, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, initializer_range=0.2)
ARCHITECTURES = {  # name -> (config class, model class, extra settings)
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, **MOE)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=4, moe_intermediate_size=32, **MOE)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(layer_types=["sliding_attention", "full_attention"],
                                                         sliding_window=12, query_pre_attn_scalar=24)),
}
# fp32 rounding: the frequencies are bit-equal and the same SDPA calls run, so 0.0 was measured; the bound leaves
# room for another CPU's kernels, far below what a wrong frequency does (the exercises' planted bugs: > 1e-2).
MAX_DELTA = 1e-4


def hf_config(arch: str, scaling: dict, theta: float = 10000.0):
    """transformers' config for a tiny `arch` model with `scaling` (Gemma 3: on its full-attention layers only)."""
    config_class, _, extra = ARCHITECTURES[arch]
    max_positions = TRAINED if scaling["rope_type"] == "dynamic" else 4 * TRAINED
    rope = {"rope_theta": theta, **scaling}
    if arch == "gemma3":
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
    return config_class(**SMALL, **extra, max_position_embeddings=max_positions, rope_parameters=rope)


def make_checkpoint(folder, arch: str, scaling: dict, seed: int = 0):
    """A seeded random model saved by transformers into `folder`; transformers' model, in eval mode."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch][1](hf_config(arch, scaling)).eval()
    with torch.no_grad():  # every tensor matters: norms away from their identity, weights big enough to route
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if arch == "gemma3" else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None  # random weights: a fixed number of tokens
    return model


def prompt(n: int, seed: int = 1):
    return torch.randint(3, SMALL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", [*SCALINGS, *VARIANTS])
def test_frequencies_and_attention_factor_equal_transformers_init_functions(name):
    scaling = {**SCALINGS, **VARIANTS}[name]
    hf = hf_config("llama", scaling, theta=5e5)
    ours = ModelConfig.from_dict(json.loads(hf.to_json_string()))
    theirs = ROPE_INIT_FUNCTIONS.get(scaling["rope_type"], lambda c, device, seq_len: default_init(c))
    for seq_len in (None, TRAINED, 3 * TRAINED + 5):  # the length matters to dynamic and longrope only
        inv_freq, factor = rope_parameters(ours, seq_len=seq_len)
        ref_inv_freq, ref_factor = theirs(hf, None, seq_len=seq_len)
        assert torch.equal(inv_freq, ref_inv_freq), (name, seq_len, (inv_freq - ref_inv_freq).abs().max())
        assert factor == ref_factor, (name, factor, ref_factor)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("rope_type", list(SCALINGS))
def test_logits_and_greedy_tokens_past_the_trained_length_equal_transformers(arch, rope_type, tmp_path):
    theirs = make_checkpoint(tmp_path, arch, SCALINGS[rope_type])
    ids = prompt(3 * TRAINED)  # 96 positions, three times the trained length
    with torch.inference_mode():
        delta = (load(tmp_path)(ids) - theirs(ids).logits).abs().max().item()
    assert delta <= MAX_DELTA, delta
    short = ids[:, :TRAINED - 4]  # a prompt inside the trained length, decoding past it: longrope switches factors
    for use_cache in (True, False) if rope_type in ("dynamic", "longrope") else (True,):  # the others: one path
        expected = theirs.generate(short, max_new_tokens=40, do_sample=False, min_new_tokens=40, use_cache=use_cache)
        ours = generate(load(tmp_path), short, 40, eos_token_id=None, use_cache=use_cache)
        assert torch.equal(ours, expected), (use_cache, ours[0, short.shape[1]:], expected[0, short.shape[1]:])


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_types_follow_transformers_from_call_to_call(rope_type, tmp_path):
    # dynamic's length grows with the longest pass and resets below the trained length; a cached key keeps the
    # rotation it was written with. The same sequence of calls on both sides, each compared.
    theirs = make_checkpoint(tmp_path, "llama", SCALINGS[rope_type])
    ours = load(tmp_path)
    with torch.inference_mode():
        for n in (3 * TRAINED, 2 * TRAINED, TRAINED, TRAINED - 7, 2 * TRAINED + 3):
            ids = prompt(n, seed=n)
            delta = (ours(ids) - theirs(ids).logits).abs().max().item()
            assert delta <= MAX_DELTA, (n, delta)
    generated = theirs.generate(prompt(40), max_new_tokens=30, do_sample=False, min_new_tokens=30)
    assert torch.equal(generate(ours, prompt(40), 30, eos_token_id=None), generated)


def test_the_two_config_spellings_give_the_same_model(tmp_path):
    # transformers 5's rope_parameters (theta inside) and the hub's rope_theta + rope_scaling with `type`
    make_checkpoint(tmp_path, "llama", SCALINGS["yarn"])
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
    hub = ModelConfig.from_dict(cfg)
    assert hub.rope_scaling == ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text())).rope_scaling
    assert hub.rope_scaling["rope_type"] == "yarn"


def test_gemma3_hub_spelling_scales_the_full_layers_only(tmp_path):
    theirs = make_checkpoint(tmp_path, "gemma3", SCALINGS["linear"])
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"], cfg["rope_local_base_freq"] = rope["full_attention"]["rope_theta"], 1000.0
    cfg["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load(tmp_path)
    assert ours.config.rope_scaling["rope_type"] == "linear" and ours.config.rope_local_scaling is None
    ids = prompt(3 * TRAINED)
    with torch.inference_mode():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= MAX_DELTA


def test_gemma3_scales_the_sliding_layers_when_a_transformers_5_config_asks():
    # transformers applies a sliding_attention entry's scaling to the sliding layers: so do we
    hf = hf_config("gemma3", SCALINGS["yarn"])
    cfg = json.loads(hf.to_json_string())
    cfg["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    ours = Gemma3(Gemma3Config.from_dict(cfg))
    for kind, rope in (("full_attention", ours.rope), ("sliding_attention", ours.rope_local)):
        ref = getattr(model.model.rotary_emb, f"{kind}_inv_freq")
        assert torch.equal(rope.inv_freq, ref), kind
        assert rope.attention_scaling == getattr(model.model.rotary_emb, f"{kind}_attention_scaling"), kind


def llama_config(**rope) -> dict:
    return json.loads(hf_config("llama", SCALINGS["linear"]).to_json_string()) | {"rope_parameters": rope}


@pytest.mark.parametrize("rope, words", [
    ({"rope_type": "linear"}, ["'linear'", "lacks ['factor']"]),
    ({"rope_type": "yarn", "original_max_position_embeddings": 32}, ["'yarn'", "lacks ['factor']"]),
    ({"rope_type": "dynamic", "factor": -2.0}, ["rope_parameters.factor", "positive", "-2.0"]),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}, ["rope_parameters.beta_fast"]),
    ({"rope_type": "longrope", "short_factor": [1.0] * 7, "long_factor": [2.0] * 8},
     ["rope_parameters.short_factor", "8 numbers", "got 7"]),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7 + [0.0]},
     ["rope_parameters.long_factor[7]", "positive"]),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8}, ["'longrope'", "lacks ['long_factor']"]),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, ["'llama3'", "lacks ['high_freq_factor']"]),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
     ["rope_parameters.original_max_position_embeddings", ">= 1"]),
    ({"rope_type": "ntk-by-parts", "factor": 4.0}, ["rope_parameters.rope_type 'ntk-by-parts'", *map(repr, ROPE_TYPES)]),
])
def test_malformed_parameters_are_one_config_error_naming_the_key(rope, words):
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_dict(llama_config(rope_theta=10000.0, **rope))
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def test_a_hub_spelling_error_names_rope_scaling():
    cfg = llama_config(rope_theta=10000.0, rope_type="default")
    cfg.pop("rope_parameters")
    cfg["rope_scaling"] = {"type": "su", "factor": 2.0}  # Phi-3's early name for longrope
    with pytest.raises(ConfigError, match=r"rope_scaling.rope_type 'su' is not a RoPE scaling we know"):
        ModelConfig.from_dict(cfg)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3"])
def test_unknown_types_are_refused_on_every_architecture(arch, tmp_path):
    make_checkpoint(tmp_path, arch, SCALINGS["linear"])
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg["rope_parameters"]
    (rope["full_attention"] if arch == "gemma3" else rope)["rope_type"] = "xpos"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_type 'xpos'.*supported"):
        load(tmp_path)


@pytest.mark.parametrize("rope_type", list(SCALINGS))
def test_verify_passes_on_a_checkpoint_of_each_type(rope_type, tmp_path, capsys):
    # The command's main, in process, on a tiny llama with SmolLM2's tokenizer: greedy tokens and perplexity windows
    # run past the trained length of 32.
    folder, tokenizer = tmp_path / "model", checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    torch.manual_seed(0)
    config = hf_config("llama", SCALINGS[rope_type])
    config.vocab_size, config.tie_word_embeddings = 49152, True
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    text = tmp_path / "text.txt"
    text.write_text("The rotary embedding turns each pair of dimensions by an angle that grows with the position. "
                    * 20, encoding="utf-8")
    code = cli.main(["verify", "--model", str(folder), "--device", "cpu", "--new-tokens", "40", "--text", str(text),
                     "--max-eval-tokens", "160", "--out", str(tmp_path / "plots")])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    for line in ("greedy tokens       PASS    40 of 40 tokens identical", "last-token logits   PASS",
                 "perplexity          PASS"):
        assert line in out, out


def test_lesson_12s_compiled_step_traces_the_length_dependent_frequencies(tmp_path):
    # one graph (fullgraph), no host read of the length, dynamic's remembered length updated in place: the compiled
    # decode steps give the eager tokens (longrope's choice is one torch.where of the same kind)
    make_checkpoint(tmp_path, "llama", SCALINGS["dynamic"])
    ids = prompt(20)
    eager = generate(load(tmp_path), ids, 40, eos_token_id=None)
    step = StaticDecodeStep(load(tmp_path), 60, backend="eager")
    assert torch.equal(step.generate(ids, 40, eos_token_id=None), eager)
