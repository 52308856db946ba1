"""Every architecture hardway loads meets the model contract of lesson 06 (hardway.loading.CausalLM).

Each model is loaded through `hardway.loading.load` in a fresh interpreter, so nothing imported by another test (or
by this one) can have prepared the ground: `load` must find the class through MODEL_CLASSES on its own. The child
checks the members' presence, their signatures and what they do, and prints one JSON line that the test reads.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM

from hardway.formats.hub import checkpoint

ROOT = Path(__file__).resolve().parent.parent

# Runs in the child. Prints {"ok": true, ...facts} or raises (a traceback on stderr, a non-zero exit).
CHILD = r'''
import inspect, json, sys
import torch

from hardway.loading import MODEL_CLASSES, CausalLM, load

folder = sys.argv[1]
before = set(sys.modules)
model = load(folder)
# built with shapes only (no initialisers, RoPE computed on the CPU): nothing on the way imported torch's compiler,
# most of a second of every start-up
assert "torch._dynamo" not in sys.modules, "loading a model imported torch._dynamo"
assert isinstance(model, CausalLM), [m for m in ("config", "max_seq_len", "eos_token_ids", "new_kv_cache", "forward",
                                     "embed", "blocks", "final_norm", "qkv", "from_checkpoint") if not hasattr(model, m)]

def params(fn):
    return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())]

assert params(model.forward) == [("input_ids", inspect.Parameter.empty), ("kv_cache", None), ("start_pos", 0),
                                 ("last_only", False), ("attention_mask", None)], params(model.forward)
assert params(model.new_kv_cache) == [("batch_size", inspect.Parameter.empty), ("max_len", None)], params(model.new_kv_cache)
assert params(model.embed) == [("input_ids", inspect.Parameter.empty), ("start_pos", 0)], params(model.embed)
assert [n for n, _ in params(model.qkv)] == ["layer", "x"]
assert isinstance(model.max_seq_len, int) and model.max_seq_len > 0
assert isinstance(model.eos_token_ids, list) and all(isinstance(i, int) for i in model.eos_token_ids)
assert not model.training

V = model(torch.zeros(1, 1, dtype=torch.long)).shape[-1]
ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    normed = []
    hook = model.final_norm.register_forward_hook(lambda m, i, o: normed.append(o))
    full = model(ids)  # (2, 9, V)
    hook.remove()
    assert full.shape == (2, 9, V)
    last = model(ids, last_only=True)
    assert last.shape == (2, 1, V)
    # last_only runs the head on the last position alone: a matrix-vector product where the full pass runs a
    # matrix-matrix one, on the same inputs, and the two kernels may sum in different orders. Each result is within
    # gamma_C * sum_i |x_i| |w_i| of the exact dot product (C terms, fp32's unit roundoff u = 2^-24, gamma_C =
    # C u / (1 - C u): the classic bound for any summation order), so the two are within twice that. A bound from
    # the dtype and the magnitudes, the same on every CPU; a wrong position or a wrong head misses it by far.
    x = normed[0][:, -1]  # (2, C): the final norm's output at the last position
    C, u = x.shape[-1], 2.0 ** -24
    head = min((p for p in model.parameters() if p.shape == (V, C)),
               key=lambda w: (torch.nn.functional.linear(x, w) - full[:, -1]).abs().max().item())  # (V, C)
    bound = 2 * C * u / (1 - C * u) * (x.abs() @ head.abs().T)  # (2, V)
    last_delta = (last[:, 0] - full[:, -1]).abs()  # (2, V)
    assert (last_delta <= bound).all(), (last_delta.max().item(), (last_delta / bound).max().item())
    assert ((full[:, -2] - full[:, -1]).abs() > bound).any()  # the previous position's logits miss the bound

    cache = model.new_kv_cache(2)  # max_len defaults to max_seq_len
    assert cache.max_len == model.max_seq_len and cache.batch_size == 2
    cache = model.new_kv_cache(2, 12)
    steps = [model(ids[:, :5], kv_cache=cache, start_pos=0)]
    steps += [model(ids[:, p:p + 1], kv_cache=cache, start_pos=p) for p in range(5, 9)]
    cached = torch.cat(steps, dim=1)
    cached_delta = (cached - full).abs().max().item()

    # attention_mask (lesson 13): row 1 left-padded by 3 gives, at its real positions, the logits of its 6 tokens
    # alone, in a full pass and through the cache, prefill then one token per step with the mask growing.
    padded = torch.cat([ids[1:, :3], ids[1:, 3:]], dim=1)  # (1, 9): 3 filler tokens, then the 6 real ones
    batch = torch.cat([ids[:1], padded])  # (2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    alone = model(ids[1:, 3:])  # (1, 6, V)
    masked = model(batch, attention_mask=mask)  # (2, 9, V)
    cache = model.new_kv_cache(2, 9)
    steps = [model(batch[:, :5], kv_cache=cache, start_pos=0, attention_mask=mask[:, :5])]
    steps += [model(batch[:, p:p + 1], kv_cache=cache, start_pos=p, attention_mask=mask[:, :p + 1]) for p in range(5, 9)]
    masked_cached = torch.cat(steps, dim=1)
    padded_delta = max((masked[1, 3:] - alone[0]).abs().max().item(), (masked_cached[1, 3:] - alone[0]).abs().max().item(),
                       (masked[0] - full[0]).abs().max().item())
    try:
        model(batch, attention_mask=mask[:, :8])
    except ValueError:
        pass
    else:
        raise AssertionError("forward accepted an attention_mask of the wrong length")

    # The diagnostics' view: embed -> blocks -> final_norm is the forward pass, and qkv is the attention input of a
    # layer that attends (layer 0, but in a hybrid whose first layers keep a state instead, lesson 27).
    x = model.embed(ids)  # (2, 9, C)
    hidden = []
    hooks = [b.register_forward_hook(lambda m, i, o: hidden.append(o)) for b in model.blocks]
    norm = []
    hooks.append(model.final_norm.register_forward_hook(lambda m, i, o: norm.append(o)))
    entering = []
    hooks.append(model.blocks[0].register_forward_pre_hook(lambda m, a: entering.append(a[0])))
    model(ids)
    for h in hooks:
        h.remove()
    assert torch.equal(entering[0], x), "embed() is not what enters the first block"
    assert len(hidden) == len(model.blocks) and norm[0].shape == x.shape
    q, k, v = model.qkv(next(i for i, b in enumerate(model.blocks) if hasattr(b, "attn")), x)
    assert q.shape[0] == 2 and q.shape[2] == 9 and q.shape[-1] == k.shape[-1]
    assert k.shape[:3] == v.shape[:3]  # a value as wide as its key, or narrower (latent attention's, lesson 29)
    assert q.shape[1] % k.shape[1] == 0  # grouped-query attention: whole groups

    for bad in (dict(max_len=model.max_seq_len + 1),):
        try:
            model.new_kv_cache(1, **bad)
        except ValueError:
            pass
        else:
            raise AssertionError("new_kv_cache accepted a max_len above max_seq_len")
    try:
        model(torch.zeros(1, model.max_seq_len + 1, dtype=torch.long))
    except ValueError:
        pass
    else:
        raise AssertionError("forward accepted more positions than max_seq_len")

print(json.dumps({"ok": True, "class": f"{type(model).__module__}.{type(model).__name__}",
                  "table": MODEL_CLASSES, "cached_delta": cached_delta, "padded_delta": padded_delta,
                  "logit_scale": full.abs().max().item(), "last_delta": last_delta.max().item(),
                  "last_delta_over_bound": (last_delta / bound).max().item(),
                  "imported_model_modules": sorted(m for m in set(sys.modules) - before
                                                   if m in ("hardway.models.gpt2", "hardway.models.llama",
                                                            "hardway.models.qwen3", "hardway.models.gemma3",
                                                            "hardway.models.moe", "hardway.models.qwen3_5",
                                                            "hardway.models.latent_attention",
                                                            "hardway.models.deepseek_v3",
                                                            "hardway.models.gpt_oss"))}))
'''

TINY = dict(vocab_size=128, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


def tiny_checkpoint(kind: str, folder: Path) -> Path:
    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_layer=2, n_head=4, n_embd=64, n_positions=64,
                                           bos_token_id=1, eos_token_id=2))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                             num_key_value_heads=2, **TINY))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                             num_key_value_heads=2, **TINY))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=32, **TINY))
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                                 initializer_range=0.2, **TINY))
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                                   num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                                                   num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0],
                                                   initializer_range=0.2, **TINY))
    elif kind == "qwen3_5":  # Gated DeltaNet layers around one full-attention layer
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                     num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                                                     linear_num_value_heads=4, linear_key_head_dim=16,
                                                     linear_value_head_dim=16, initializer_range=0.2,
                                                     **{**TINY, "num_hidden_layers": 4}))
    elif kind == "deepseek_v3":  # latent attention; a dense layer, then one with experts in groups
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
            first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12, initializer_range=0.2, **TINY))
    elif kind == "gpt_oss":  # sinks, a window of 4 on layers 0 and 2, experts with biases
        model = GptOssForCausalLM(GptOssConfig(hidden_size=64, intermediate_size=32, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=16, sliding_window=4,
                                               num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
                                               **{**TINY, "num_hidden_layers": 3}))
    else:  # a sliding window of 4 < the 9 positions the child runs: layers 0 and 2 mask keys out of it
        model = Gemma3ForCausalLM(Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                   num_key_value_heads=2, head_dim=16, sliding_window=4,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"], **{**TINY, "num_hidden_layers": 3}))
    model.save_pretrained(folder)
    return folder


CASES = {  # name -> (how to get the folder, the class load must pick)
    "gpt2-tiny": (lambda tmp: tiny_checkpoint("gpt2", tmp / "gpt2"), "hardway.models.gpt2.GPT"),
    "llama-tiny": (lambda tmp: tiny_checkpoint("llama", tmp / "llama"), "hardway.models.llama.Llama"),
    "qwen2-tiny": (lambda tmp: tiny_checkpoint("qwen2", tmp / "qwen2"), "hardway.models.llama.Llama"),
    "qwen3-tiny": (lambda tmp: tiny_checkpoint("qwen3", tmp / "qwen3"), "hardway.models.qwen3.Qwen3"),
    "gemma3-tiny": (lambda tmp: tiny_checkpoint("gemma3", tmp / "gemma3"), "hardway.models.gemma3.Gemma3"),
    "qwen3_5-tiny": (lambda tmp: tiny_checkpoint("qwen3_5", tmp / "qwen3_5"), "hardway.models.qwen3_5.Qwen35"),
    "deepseek_v3-tiny": (lambda tmp: tiny_checkpoint("deepseek_v3", tmp / "deepseek_v3"),
                         "hardway.models.deepseek_v3.DeepseekV3"),
    "mixtral-tiny": (lambda tmp: tiny_checkpoint("mixtral", tmp / "mixtral"), "hardway.models.moe.MoE"),
    "gpt_oss-tiny": (lambda tmp: tiny_checkpoint("gpt_oss", tmp / "gpt_oss"), "hardway.models.gpt_oss.GptOss"),
    "qwen3_moe-tiny": (lambda tmp: tiny_checkpoint("qwen3_moe", tmp / "qwen3_moe"), "hardway.models.moe.MoE"),
    "gpt2-standin": (lambda tmp: checkpoint("openai-community/gpt2"), "hardway.models.gpt2.GPT"),
    "smollm2-standin": (lambda tmp: checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct"), "hardway.models.llama.Llama"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_architecture_meets_the_contract_in_a_fresh_interpreter(case, tmp_path):
    make_folder, expected_class = CASES[case]
    folder = make_folder(tmp_path)
    result = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, cwd=ROOT,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["class"] == expected_class
    # The cached path and left padding with its mask change the logits by fp32 rounding only: other matmul shapes
    # (one row against nine, at every layer) and another attention kernel sum in another order (lesson 13), and the
    # errors grow with the activations, so the bound is relative to the logits' size. Measured on SmolLM2 (logits up
    # to 33.5): 7.8e-5 cached (2.3e-6 of the size) and 2.6e-4 padded (7.7e-6), where transformers' own
    # padded-vs-alone difference is 7e-5.
    assert facts["cached_delta"] <= 2e-5 * facts["logit_scale"], facts
    assert facts["padded_delta"] <= 2e-5 * facts["logit_scale"], facts
    # load imported the model module this checkpoint needs and the ones it builds on (Llama's imports GPT-2's for the
    # causal mask; lesson 20's import Llama's pieces and its weight loading; lesson 21's MoE Qwen3's
    # attention and Gemma 3's window mask), no other
    module = expected_class.rsplit(".", 1)[0]
    builds_on = {"hardway.models.gpt2": set(), "hardway.models.llama": {"hardway.models.gpt2"},
                 "hardway.models.qwen3": {"hardway.models.gpt2", "hardway.models.llama"},
                 "hardway.models.gemma3": {"hardway.models.gpt2", "hardway.models.llama"},
                 "hardway.models.moe": {"hardway.models.gpt2", "hardway.models.llama", "hardway.models.qwen3",
                                        "hardway.models.gemma3"},
                 "hardway.models.qwen3_5": {"hardway.models.gpt2", "hardway.models.llama", "hardway.models.gemma3"},
                 "hardway.models.deepseek_v3": {"hardway.models.gpt2", "hardway.models.llama", "hardway.models.qwen3",
                                                "hardway.models.gemma3", "hardway.models.moe",
                                                "hardway.models.latent_attention"},
                 "hardway.models.gpt_oss": {"hardway.models.gpt2", "hardway.models.llama", "hardway.models.qwen3",
                                            "hardway.models.gemma3", "hardway.models.moe"}}
    assert set(facts["imported_model_modules"]) == {module} | builds_on[module], facts


def test_the_model_table_is_explicit_and_lazy():
    result = subprocess.run([sys.executable, "-c", "import sys, json; from hardway.loading import MODEL_CLASSES; "
                             "print(json.dumps([MODEL_CLASSES, sorted(m for m in sys.modules if m.startswith('hardway'))]))"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    table, imported = json.loads(result.stdout)
    assert table == {"gpt2": "hardway.models.gpt2:GPT", "llama": "hardway.models.llama:Llama", "qwen2": "hardway.models.llama:Llama",
                     "qwen3": "hardway.models.qwen3:Qwen3", "gemma3_text": "hardway.models.gemma3:Gemma3",
                     "mixtral": "hardway.models.moe:MoE", "qwen3_moe": "hardway.models.moe:MoE",
                     "qwen3_5_text": "hardway.models.qwen3_5:Qwen35", "qwen3_5": "hardway.models.qwen3_5:Qwen35",
                     "deepseek_v3": "hardway.models.deepseek_v3:DeepseekV3",
                     "gemma4_text": "hardway.models.gemma4:Gemma4", "gemma4": "hardway.models.gemma4:Gemma4",
                     "gpt_oss": "hardway.models.gpt_oss:GptOss"}
    assert not {"hardway.models.gpt2", "hardway.models.llama", "hardway.models.qwen3", "hardway.models.gemma3",
                "hardway.models.moe", "hardway.models.qwen3_5", "hardway.models.deepseek_v3",
                "hardway.models.latent_attention", "hardway.models.gemma4", "hardway.models.gpt_oss",
                "hardway.models.kv_cache"} & set(imported), imported


def test_no_module_imports_hardway_as_a_whole():
    offenders = [f"{p.name}:{i}" for p in (ROOT / "hardway").glob("*.py")
                 for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if line.strip() == "import hardway"]
    assert not offenders, offenders
