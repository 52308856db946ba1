"""hardway.models.qwen3 against transformers' Qwen3ForCausalLM, on tiny seeded random models: head_dim set apart from
hidden/heads, tied and untied heads, q/k/v/o biases; logits, greedy tokens, the KV cache, left-padded batches."""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from hardway.decode.generate import generate
from hardway.errors import ConfigError
from hardway.loading import load
from hardway.models.qwen3 import Qwen3, qwen3_config

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
CASES = {
    "head_dim-32-untied": dict(head_dim=32, tie_word_embeddings=False),   # 4 heads x 32 = 128 != hidden 64
    "head_dim-16-tied": dict(head_dim=16, tie_word_embeddings=True),
    "biases": dict(head_dim=16, attention_bias=True, tie_word_embeddings=False),
}
# fp32 rounding: the same SDPA calls as transformers give 0.0 (measured); 1e-5 leaves room for another CPU's kernels.
MAX_DELTA = 1e-5


def make_checkpoint(folder, case, seed=0):
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, **CASES[case])).eval()
    with torch.no_grad():  # the default init leaves norms at 1 and biases at 0: make every tensor matter
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return model


def prompt(n=30, seed=1):
    return torch.randint(3, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(case, tmp_path):
    theirs = make_checkpoint(tmp_path, case)
    ours = load(tmp_path)
    assert type(ours) is Qwen3 and ours.sliding_windows == (None, None)
    ids = prompt()
    with torch.inference_mode():
        delta = (ours(ids) - theirs(ids).logits).abs().max().item()
    assert delta <= MAX_DELTA, delta
    expected = theirs.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, min_new_tokens=40)
    assert torch.equal(generate(ours, ids, 40, eos_token_id=None), expected)
    assert torch.equal(generate(ours, ids, 40, eos_token_id=None, use_cache=False), expected)  # no cache: the same


def test_a_left_padded_batch_equals_each_row_alone(tmp_path):
    make_checkpoint(tmp_path, "head_dim-32-untied")
    ours = load(tmp_path)
    rows = [prompt(20, seed=3)[0], prompt(7, seed=4)[0]]
    ids = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 20 - len(r):], mask[i, 20 - len(r):] = r, 1
    out = generate(ours, ids, 24, eos_token_id=None, attention_mask=mask)
    for i, r in enumerate(rows):
        assert torch.equal(out[i, 20:], generate(ours, r[None], 24, eos_token_id=None)[0, len(r):]), i


def test_config_refusals_and_defaults():
    base = json.loads(Qwen3Config(**TINY, head_dim=16).to_json_string())
    with pytest.raises(ConfigError, match="use_sliding_window"):
        qwen3_config({**base, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="hidden_act"):
        qwen3_config({**base, "hidden_act": "gelu"})
    no_head_dim = {k: v for k, v in base.items() if k != "head_dim"}
    assert qwen3_config(no_head_dim).head_dim == Qwen3Config(**TINY).head_dim == 128  # transformers' default


def test_olmo2_norms_the_whole_projection_where_qwen3_norms_each_head():
    """Lesson 20: OLMo 2's q/k norm is one RMSNorm over a token's whole projection (num_heads * head_dim numbers, a
    weight that wide), Qwen3's one per head (head_dim numbers, a weight shared by the heads). On transformers' own
    attention classes with several heads: lesson 09's RMSNorm over the whole width is OLMo 2's, a norm per head is
    not; Qwen3's weight is head_dim wide."""
    import torch.nn.functional as F
    from transformers import Olmo2Config
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention

    from hardway.models.llama import RMSNorm

    torch.manual_seed(0)
    attn = Olmo2Attention(Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), layer_idx=0)
    x = torch.randn(2, 5, 64)  # (B, T, C)
    with torch.no_grad():
        for norm, proj, heads in ((attn.q_norm, attn.q_proj, 4), (attn.k_norm, attn.k_proj, 2)):
            norm.weight.normal_(1, 0.2)
            y = proj(x)  # (B, T, heads * 16)
            width = heads * attn.head_dim
            assert norm.weight.shape == (width,)
            whole = RMSNorm(width, norm.variance_epsilon)
            whole.weight.copy_(norm.weight)
            assert torch.equal(whole(y), norm(y))
            per_head = F.rms_norm(y.view(2, 5, heads, attn.head_dim), (attn.head_dim,), eps=norm.variance_epsilon)
            assert (per_head.reshape(2, 5, width) * norm.weight - norm(y)).abs().max() > 1e-2
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**TINY, **CASES["head_dim-16-tied"]))
    assert qwen3.model.layers[0].self_attn.q_norm.weight.shape == (16,)  # one head's width: QKNormAttention's
