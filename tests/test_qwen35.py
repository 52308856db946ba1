"""hardway.models.qwen3_5 against transformers' Qwen3_5ForCausalLM, on tiny random models: the two forms of the gated
delta rule against each other and against transformers' functions, the layer, the whole model (logits, greedy tokens
with and without the cache, a left-padded batch), the config's checks, and a state that refuses to rewind."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as reference

from hardway.decode.generate import generate
from hardway.errors import ConfigError
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.models.qwen3_5 import Qwen35, delta_rule_chunked, delta_rule_recurrent, qwen35_config

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=24, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
CASES = {
    "3-linear-1-full-untied": dict(num_hidden_layers=4, tie_word_embeddings=False),
    "tied-half-rotary-1:1-heads": dict(num_hidden_layers=3, tie_word_embeddings=True, linear_num_value_heads=2,
                                       layer_types=["linear_attention", "full_attention", "linear_attention"],
                                       rope_parameters={**TINY["rope_parameters"], "partial_rotary_factor": 0.5}),
    "full-first-conv-3": dict(num_hidden_layers=4, tie_word_embeddings=False, linear_conv_kernel_dim=3,
                              layer_types=["full_attention", "linear_attention", "linear_attention",
                                           "full_attention"]),
}
# Measured: 2e-5 to 3e-5 on these models (the chunked rule's products summed in another order than transformers');
# the bound the lesson promises is 1e-4.
MAX_DELTA = 1e-4


def randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 8).log())
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.normal_(0, 0.15)
    return model.eval()


def make_checkpoint(folder, case, seed=0):
    torch.manual_seed(seed)
    model = randomize(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY, **CASES[case]})))
    model.save_pretrained(folder)
    return model


def prompt(n, seed=1):
    return torch.randint(3, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def random_rule_inputs(T, seed=3, B=2, H=3, d_k=16, d_v=24):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, d_k, generator=g), dim=-1) * d_k ** -0.5  # (B, H, T, d_k)
    k = F.normalize(torch.randn(B, H, T, d_k, generator=g), dim=-1)
    v = torch.randn(B, H, T, d_v, generator=g)
    return q, k, v, -torch.rand(B, H, T, generator=g), torch.rand(B, H, T, generator=g), \
        torch.randn(B, H, d_k, d_v, generator=g)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_the_two_forms_agree_and_each_equals_transformers(T):
    q, k, v, g, beta, s0 = random_rule_inputs(T)
    out_rec, state_rec = delta_rule_recurrent(q, k, v, g, beta, s0)
    out_chunk, state_chunk = delta_rule_chunked(q, k, v, g, beta, s0)
    assert (out_rec - out_chunk).abs().max() <= 1e-5 and (state_rec - state_chunk).abs().max() <= 1e-5
    args = [x.transpose(1, 2) for x in (q * q.shape[-1] ** 0.5, k, v)]
    for name, out, state in (("torch_recurrent_gated_delta_rule", out_rec, state_rec),
                             ("torch_chunk_gated_delta_rule", out_chunk, state_chunk)):
        theirs, theirs_state = getattr(reference, name)(*args, g=g.transpose(1, 2), beta=beta.transpose(1, 2),
                                                        initial_state=s0, output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
        assert (out - theirs.transpose(1, 2)).abs().max() <= 1e-5, name
        assert (state - theirs_state).abs().max() <= 1e-5, name


def test_chunks_of_any_size_give_the_same_answer():
    q, k, v, g, beta, s0 = random_rule_inputs(100)
    expected, expected_state = delta_rule_recurrent(q, k, v, g, beta, s0)
    for size in (1, 7, 32, 128):
        out, state = delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=size)
        assert (out - expected).abs().max() <= 1e-5 and (state - expected_state).abs().max() <= 1e-5, size


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(case, tmp_path):
    theirs = make_checkpoint(tmp_path, case)
    ours = load(tmp_path)
    assert type(ours) is Qwen35
    ids = prompt(200)  # three chunks of 64 and a part
    with torch.inference_mode():
        delta = (ours(ids) - theirs(ids).logits).abs().max().item()
        assert delta <= MAX_DELTA, delta
        expected = theirs.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, min_new_tokens=30)
        assert torch.equal(generate(ours, ids, 30, eos_token_id=None), expected)
        assert torch.equal(generate(ours, ids, 30, eos_token_id=None, use_cache=False), expected)


def test_a_left_padded_batch_equals_each_row_alone_and_transformers(tmp_path):
    theirs = make_checkpoint(tmp_path, "3-linear-1-full-untied")
    ours = load(tmp_path)
    rows = [prompt(70, seed=3)[0], prompt(9, seed=4)[0], prompt(33, seed=5)[0]]
    ids, mask = torch.zeros(3, 70, dtype=torch.long), torch.zeros(3, 70, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 70 - len(row):], mask[i, 70 - len(row):] = row, 1
    with torch.inference_mode():
        together = generate(ours, ids, 25, eos_token_id=None, attention_mask=mask)
        for i, row in enumerate(rows):
            assert torch.equal(together[i, 70:], generate(ours, row[None], 25, eos_token_id=None)[0, len(row):]), i
        assert torch.equal(together, theirs.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False,
                                                     eos_token_id=None, min_new_tokens=25))


def test_the_state_carries_across_passes_and_cannot_rewind(tmp_path):
    make_checkpoint(tmp_path, "3-linear-1-full-untied")
    ours = load(tmp_path)
    ids = prompt(150)
    cache = ours.new_kv_cache(1, 200)
    with torch.inference_mode():
        whole = ours(ids)
        parts = [ours(ids[:, :70], kv_cache=cache), ours(ids[:, 70:71], kv_cache=cache, start_pos=70),
                 ours(ids[:, 71:], kv_cache=cache, start_pos=71)]
        assert (torch.cat(parts, dim=1) - whole).abs().max() <= MAX_DELTA
        with pytest.raises(ValueError, match="cannot rewind"):
            ours(ids[:, :3], kv_cache=cache, start_pos=40)
        again = ours(ids[:, :70], kv_cache=cache)  # start_pos 0: starts over
        assert (again - whole[:, :70]).abs().max() <= MAX_DELTA
    assert cache.state_nbytes == sum(t.nbytes for t in cache.conv + cache.recurrent) > 0


def config_dict(**changes):
    return {**Qwen3_5TextConfig(**{**TINY, "num_hidden_layers": 4}).to_dict(), **changes}


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]), "mamba"),
    (dict(layer_types=["linear_attention", "full_attention"]), "one type for each of the 4 layers"),
    (dict(linear_num_value_heads=3), "not a multiple of linear_num_key_heads"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope_type"),
    (dict(model_type="qwen3"), "model_type"),
])
def test_a_bad_config_gets_one_clear_line(changes, message):
    with pytest.raises(ConfigError, match=message):
        qwen35_config(json.loads(json.dumps(config_dict(**changes))))


def test_load_reports_a_bad_layer_type_on_the_command_line(tmp_path):
    import subprocess
    import sys
    make_checkpoint(tmp_path, "3-linear-1-full-untied")
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"][1] = "sliding_attention"
    tokenizer = checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")  # any tokenizer: the config fails first
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    exe = Path(sys.executable).with_name("hardway")  # the installed command
    result = subprocess.run([str(exe), "generate", "--model", str(tmp_path), "--device", "cpu", "hi"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "sliding_attention" in result.stderr.strip().splitlines()[-1]
