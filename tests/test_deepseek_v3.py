"""hardway.models.deepseek_v3 against transformers' DeepseekV3ForCausalLM on tiny random models: logits and greedy
tokens on three layouts (dense layers first then experts, a plain q_proj, yarn with DeepSeek's softmax scale), the two
decode forms against each other, a left-padded batch, lesson 12's compiled step, the cache's bytes, the router, the
published size on the meta device, and the config's checks."""

import json

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from hardway.decode.generate import generate
from hardway.errors import ConfigError
from hardway.loading import load
from hardway.models.deepseek_v3 import DeepseekV3, GroupRouter, deepseek_v3_config
from hardway.models.latent_attention import LatentCache

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4,
            topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=20,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
CASES = {
    "dense-first-then-experts": {},
    "no-q-compression-not-interleaved-tied-all-experts": dict(q_lora_rank=None, rope_interleave=False,
                                                              first_k_dense_replace=0, tie_word_embeddings=True),
    "yarn-mscale-bias-2-groups-unnormalised": dict(rope_parameters=YARN, attention_bias=True, norm_topk_prob=False,
                                                   n_group=2, topk_group=1, n_shared_experts=2),
}
MAX_DELTA = 1e-4  # measured 1.4e-6 to 2.9e-6 on these models


def randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the router's balance: it changes which experts run
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def make_checkpoint(folder, case, seed=0):
    torch.manual_seed(seed)
    model = randomize(DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, **CASES[case]})))
    model.save_pretrained(folder)
    return model


def prompt(n, seed=1):
    return torch.randint(3, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers_in_both_decode_forms(case, tmp_path):
    theirs = make_checkpoint(tmp_path, case)
    ours = load(tmp_path)
    assert type(ours) is DeepseekV3
    ids = prompt(200)
    with torch.inference_mode():
        delta = (ours(ids) - theirs(ids).logits).abs().max().item()
        assert delta <= MAX_DELTA, delta
        ids = ids[:, :100]
        expected = theirs.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, min_new_tokens=20)
        for form in ("naive", "absorbed"):
            ours.decode_form = form
            assert torch.equal(generate(ours, ids, 20, eos_token_id=None), expected), form
        assert torch.equal(generate(ours, ids, 5, eos_token_id=None, use_cache=False), expected[:, :105])


def test_the_absorbed_form_equals_the_naive_one(tmp_path):
    """Every layer's one-token step, both forms, on the same cache after a 150-token prompt: ≤ 1e-5 relative."""
    make_checkpoint(tmp_path, "dense-first-then-experts")
    ours = load(tmp_path)
    ids = prompt(151)
    cache = ours.new_kv_cache(1, 200)
    out = {}
    with torch.inference_mode():
        ours(ids[:, :150], kv_cache=cache)
        for form in ("naive", "absorbed"):
            ours.decode_form = form
            out[form] = ours(ids[:, 150:], kv_cache=cache, start_pos=150)  # (1, 1, V), the same slot rewritten
        x = torch.randn(2, 1, TINY["hidden_size"])  # one layer alone, two rows, a padded mask
        attn = ours.blocks[1].attn
        cos, sin = ours.rope(torch.tensor([150]), x.dtype)
        q_nope, q_rope = attn.query(x, cos, sin)
        kv = torch.randn(2, 1, 151, 24 + 8)
        mask = torch.ones(2, 1, 1, 151, dtype=torch.bool)
        mask[1, ..., :40] = False
        naive, absorbed = attn.attend_naive(q_nope, q_rope, kv, mask), attn.attend_absorbed(q_nope, q_rope, kv, mask)
    relative = ((out["naive"] - out["absorbed"]).abs().max() / out["naive"].abs().max()).item()
    assert relative <= 1e-5, relative
    assert ((naive - absorbed).abs().max() / naive.abs().max()).item() <= 1e-5
    with pytest.raises(ValueError, match="decode_form"):
        ours.decode_form = "fast"


def test_a_left_padded_batch_equals_each_row_alone_and_transformers(tmp_path):
    theirs = make_checkpoint(tmp_path, "dense-first-then-experts")
    ours = load(tmp_path)
    rows = [prompt(70, seed=3)[0], prompt(9, seed=4)[0], prompt(33, seed=5)[0]]
    ids, mask = torch.zeros(3, 70, dtype=torch.long), torch.zeros(3, 70, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 70 - len(row):], mask[i, 70 - len(row):] = row, 1
    with torch.inference_mode():
        together = generate(ours, ids, 20, eos_token_id=None, attention_mask=mask)
        for i, row in enumerate(rows):
            assert torch.equal(together[i, 70:], generate(ours, row[None], 20, eos_token_id=None)[0, len(row):]), i
        assert torch.equal(together, theirs.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                                     eos_token_id=None, min_new_tokens=20))


def test_the_cache_holds_the_latent_and_rope_key_only(tmp_path):
    make_checkpoint(tmp_path, "dense-first-then-experts")
    ours = load(tmp_path)
    cache = ours.new_kv_cache(2, 100)
    assert isinstance(cache, LatentCache) and cache.v is None
    assert tuple(cache.k.shape) == (3, 2, 1, 100, 24 + 8)
    assert cache.bytes_per_token == 2 * 3 * (24 + 8) * 4 and cache.nbytes == 100 * cache.bytes_per_token
    with pytest.raises(ValueError, match="holds 100 positions"):
        ours(prompt(10).repeat(2, 1), kv_cache=cache, start_pos=95)


def test_lesson_12s_compiled_step_gives_generates_tokens(tmp_path):
    from hardway.decode.static import StaticDecodeStep
    make_checkpoint(tmp_path, "dense-first-then-experts")
    ours = load(tmp_path)
    ids = prompt(50)
    with torch.inference_mode():
        expected = generate(ours, ids, 12, eos_token_id=None)
        step = StaticDecodeStep(ours, max_len=62, backend="eager")  # dynamo traces the step: one graph, no breaks
        assert torch.equal(step.generate(ids, 12, eos_token_id=None), expected)
    with pytest.raises(ValueError, match="LatentCache"):
        generate(ours, ids, 2, kv_cache_dtype="int8")


def test_the_router_chooses_with_the_bias_and_weighs_without_it():
    config = deepseek_v3_config({**DeepseekV3Config(**TINY).to_dict(), "routed_scaling_factor": 2.0})
    router = GroupRouter(config)
    with torch.no_grad():
        router.weight.zero_()
        router.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 1.0, 2.0]))
    weights, experts = router(torch.randn(5, TINY["hidden_size"]))  # every score sigmoid(0) = 0.5
    assert set(experts[0].tolist()) >= {6, 7}  # the bias chose them (group 3: experts 6 and 7)
    assert torch.allclose(weights, torch.full((5, 3), 2.0 / 3))  # weighed by the unbiased 0.5s, normalised, × 2


def test_the_published_size_builds_on_the_meta_device():
    config = deepseek_v3_config({"model_type": "deepseek_v3", "rope_scaling": {
        "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}, "rope_theta": 10000, "max_position_embeddings": 163840})
    with torch.device("meta"):
        model = DeepseekV3(config)
        cache = model.new_kv_cache(1, 1000)
    assert sum(p.numel() for p in model.parameters()) > 670e9
    assert cache.bytes_per_token == 61 * (512 + 64) * 4 and cache.nbytes == 1000 * cache.bytes_per_token
    assert abs(config.softmax_scale - 192 ** -0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2) < 1e-9


def config_dict(**changes):
    return {**DeepseekV3Config(**TINY).to_dict(), **changes}


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="deepseek_v2"), "model_type"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type 'linear'"),
    (dict(n_routed_experts=6), "n_group=4"),
    (dict(topk_group=5), "topk_group=5"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(qk_rope_head_dim=7), "odd"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(quantization_config={"quant_method": "fp8"}), "fp8"),
    (dict(kv_lora_rank="512"), "kv_lora_rank"),
])
def test_a_bad_config_gets_one_clear_line(changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        deepseek_v3_config(json.loads(json.dumps(config_dict(**changes))))
    assert "\n" not in str(e.value)


def test_the_hubs_extra_prediction_layer_is_left_out(tmp_path):
    """The hub's files carry a multi-token-prediction layer after the last (model.layers.{n}): not part of the pass."""
    from safetensors.torch import load_file, save_file
    theirs = make_checkpoint(tmp_path, "dense-first-then-experts")
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    ids = prompt(40)
    with torch.inference_mode():
        assert (load(tmp_path)(ids) - theirs(ids).logits).abs().max() <= MAX_DELTA
