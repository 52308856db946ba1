"""Lesson 21's mixture-of-experts models (hardway/models/moe.py) against transformers' MixtralForCausalLM and
Qwen3MoeForCausalLM: tiny random checkpoints written by save_pretrained, read by hardway.load.

Logits within fp32 rounding and 32 greedy tokens identical; each expert computed on its routed tokens only; the KV
cache, left padding, lesson 12's compiled step and lesson 14's engine give what the plain forward pass gives."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hardway.decode.generate import generate
from hardway.decode.static import StaticDecodeStep
from hardway.errors import CheckpointError, ConfigError
from hardway.loading import load
from hardway.models.moe import MoE, MoEConfig, SparseMoE, dispatch

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
# initializer_range 0.2 (transformers' default is 0.02): router logits far enough apart that the choice of experts
# matters, and a wrong choice shows in the logits.
CASES = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=8,
                                                        num_experts_per_tok=2, **SMALL)),
    # a window of 6 < the 24-token prompts: every layer masks keys out of it (lesson 20's mask)
    "mixtral-sliding-window-6": lambda: MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=4,
                                                                         num_experts_per_tok=2, sliding_window=6,
                                                                         **SMALL)),
    "qwen3_moe-top4-renormalised-one-dense": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        intermediate_size=128, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=4, norm_topk_prob=True,
        mlp_only_layers=[1], head_dim=16, **SMALL)),
    "qwen3_moe-not-renormalised-sparse-step-2-tied": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        intermediate_size=128, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=2, tie_word_embeddings=True, **SMALL)),
}
LOGIT_BOUND = 1e-5  # fp32 rounding: the top-k sum and the grouped products add in another order (measured: 3.3e-6)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: (folder, transformers' model)}: each saved by save_pretrained, the hub's per-expert spelling."""
    out = {}
    for i, (name, make) in enumerate(CASES.items()):
        torch.manual_seed(i)
        ref = make().eval()
        folder = tmp_path_factory.mktemp(name)
        ref.save_pretrained(folder)
        ref.generation_config.eos_token_id = None  # random weights: a fixed number of tokens
        out[name] = folder, ref
    return out


def ids_for(seed, shape):
    return torch.randint(3, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(checkpoints, case):
    folder, ref = checkpoints[case]
    model = load(folder)
    assert isinstance(model, MoE)
    ids = ids_for(0, (2, 24))
    with torch.inference_mode():
        expected, ours = ref(ids).logits, model(ids)  # (2, 24, V)
    delta = (ours - expected).abs().max().item()
    assert delta <= LOGIT_BOUND, (delta, expected.abs().max().item())
    with torch.inference_mode():
        ref_tokens = ref.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=32,
                                  do_sample=False, pad_token_id=0)
    ours = generate(model, ids[:1], max_new_tokens=32, eos_token_id=None)
    assert ours.shape == (1, 24 + 32) and torch.equal(ours, ref_tokens)


def test_the_config_is_read_as_transformers_reads_it(checkpoints):
    for case, (folder, ref) in checkpoints.items():
        config = MoEConfig.from_dict(json.loads((folder / "config.json").read_text()))
        sparse = tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ref.model.layers)
        assert config.sparse_layers == sparse, case
        assert config.num_experts == ref.config.num_local_experts
        assert config.norm_topk_prob == bool(getattr(ref.config, "norm_topk_prob", True))
    # the hub's Qwen3-MoE files say num_experts, not num_local_experts
    d = json.loads((checkpoints["qwen3_moe-top4-renormalised-one-dense"][0] / "config.json").read_text())
    d["num_experts"] = d.pop("num_local_experts")
    assert MoEConfig.from_dict(d).num_experts == 8


def test_each_expert_runs_only_on_the_tokens_routed_to_it(checkpoints):
    """Every expert function call is counted, with its rows: each expert of each sparse block runs at most once per
    forward pass, on exactly the tokens whose top k include it (N·k rows in all, not N·E)."""
    for case in ("mixtral", "qwen3_moe-top4-renormalised-one-dense"):
        model = load(checkpoints[case][0])
        ids = ids_for(1, (2, 20))  # N = 40 tokens
        calls, routed = [], []
        for layer, block in enumerate(model.blocks):
            if not isinstance(block.mlp, SparseMoE):
                continue
            experts, gate = block.mlp.experts, block.mlp.gate
            expert = experts.expert
            experts.expert = lambda e, rows, layer=layer, expert=expert: calls.append((layer, e, rows.clone())) \
                or expert(e, rows)
            gate.register_forward_hook(lambda m, i, out, layer=layer: routed.append((layer, i[0], out[1])))
        with torch.inference_mode():
            model(ids)
        k = model.config.num_experts_per_tok
        for layer, x, chosen in routed:  # x: (N, C) the rows routed; chosen: (N, k)
            mine = [(e, rows) for l, e, rows in calls if l == layer]
            assert len({e for e, _ in mine}) == len(mine), "an expert ran twice in one block"
            assert sum(rows.shape[0] for _, rows in mine) == x.shape[0] * k  # N·k rows in all
            for e, rows in mine:
                tokens = (chosen == e).any(-1).nonzero().squeeze(-1)  # the tokens that chose e, in order
                assert torch.equal(rows, x[tokens]), (case, layer, e)
            assert {e for e, _ in mine} == set(chosen.unique().tolist())  # no unchosen expert ran


def test_dispatch_skips_experts_nobody_chose():
    x = torch.randn(5, 4)
    chosen = torch.tensor([[1, 3]] * 5)  # (5, 2): everyone picks experts 1 and 3
    weights = torch.full((5, 2), 0.5)
    ran = []
    out = dispatch(x, weights, chosen, lambda e, rows: ran.append(e) or rows * (e + 1), n_experts=6)
    assert ran == [1, 3] and torch.allclose(out, x * (0.5 * 2 + 0.5 * 4))


@pytest.mark.parametrize("case", ["mixtral", "mixtral-sliding-window-6", "qwen3_moe-top4-renormalised-one-dense"])
def test_kv_cache_and_left_padding_give_the_full_pass(checkpoints, case):
    model = load(checkpoints[case][0])
    ids = ids_for(2, (2, 12))
    with torch.inference_mode():
        full = model(ids)  # (2, 12, V)
        cache = model.new_kv_cache(2, 16)
        steps = [model(ids[:, :6], kv_cache=cache, start_pos=0)]
        steps += [model(ids[:, p:p + 1], kv_cache=cache, start_pos=p) for p in range(6, 12)]
        cached = torch.cat(steps, dim=1)
        bound = 2e-5 * full.abs().max().item()  # fp32 rounding of other matmul shapes, as tests/test_contract.py
        assert (cached - full).abs().max().item() <= bound
        # row 1 left-padded by 4: its real positions give its 8 tokens alone
        batch = ids.clone()
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        alone = model(ids[1:, 4:])  # (1, 8, V)
        padded = model(batch, attention_mask=mask)
        assert (padded[1, 4:] - alone[0]).abs().max().item() <= bound
        assert (padded[0] - full[0]).abs().max().item() <= bound
    # and through generate: a left-padded batch gives each row's tokens alone
    prompts = [ids[0, :12], ids[1, 4:]]
    together = generate(model, batch, max_new_tokens=8, eos_token_id=None, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        alone_tokens = generate(model, prompt[None], max_new_tokens=8, eos_token_id=None)
        assert torch.equal(together[row, -8:], alone_tokens[0, -8:])


@pytest.mark.parametrize("case", ["mixtral-sliding-window-6", "qwen3_moe-top4-renormalised-one-dense"])
def test_the_compiled_step_traces_as_one_graph_and_gives_eager_tokens(checkpoints, case):
    """Lesson 12's StaticDecodeStep compiles the one-token step whole (fullgraph): the block takes its gathered
    path there. The "eager" backend checks the tracing without inductor's compile time."""
    model = load(checkpoints[case][0])
    ids = ids_for(3, (1, 10))
    step = StaticDecodeStep(model, 64, backend="eager")
    assert torch.equal(step.generate(ids, max_new_tokens=12, eos_token_id=None),
                       generate(model, ids, max_new_tokens=12, eos_token_id=None))


def test_the_engine_serves_an_moe_as_generate_alone(tmp_path):
    """Lesson 14's engine (paged cache, batches of prompts) on a Mixtral with a window of 3, shorter than the prompts."""
    from hardway.engine.engine import Engine
    from hardway.engine.sequence import SamplingParams
    from hardway.formats.hub import checkpoint
    from hardway.text.tokenizer import load_tokenizer

    torch.manual_seed(5)
    tok = load_tokenizer(checkpoint("openai-community/gpt2"))
    MixtralForCausalLM(MixtralConfig(**(SMALL | dict(vocab_size=50257, hidden_size=32)), intermediate_size=48,
                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=3)).save_pretrained(tmp_path)
    model = load(tmp_path)
    prompts = [tok.encode(p) for p in ("The capital of France is", "Once upon a time", "1, 2, 3,")]
    n = 6
    expected = [generate(model, torch.tensor([p]), max_new_tokens=n, eos_token_id=None)[0, len(p):].tolist()
                for p in prompts]
    engine = Engine(model, tok, n_blocks=16, block_size=4, max_batch=3)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[]))
    assert [s.output_ids for s in seqs] == expected


def test_load_reads_the_stacked_spelling_too(checkpoints, tmp_path):
    """A file holding transformers 5's in-memory names (mlp.experts.gate_up_proj, 3-D) loads to the same model."""
    folder, ref = checkpoints["mixtral"]
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ids = ids_for(4, (1, 9))
    with torch.inference_mode():
        assert torch.equal(load(tmp_path)(ids), load(folder)(ids))


def test_bad_configs_and_files_are_refused_in_one_line(checkpoints, tmp_path):
    folder, _ = checkpoints["mixtral"]
    d = json.loads((folder / "config.json").read_text())
    assert MoEConfig.from_dict(d | {"sliding_window": 4096}).sliding_window == 4096
    with pytest.raises(ConfigError, match="sliding_window"):
        MoEConfig.from_dict(d | {"sliding_window": 0})
    with pytest.raises(ConfigError, match="num_experts_per_tok=9 is more than the 8 experts"):
        MoEConfig.from_dict(d | {"num_experts_per_tok": 9})
    q = json.loads((checkpoints["qwen3_moe-top4-renormalised-one-dense"][0] / "config.json").read_text())
    with pytest.raises(ConfigError, match="use_sliding_window=true .* not implemented for qwen3_moe"):
        MoEConfig.from_dict(q | {"use_sliding_window": True})
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        MoEConfig.from_dict({k: v for k, v in q.items() if k != "moe_intermediate_size"})
    # a file missing one expert: the names, not a KeyError from deep inside
    from safetensors.torch import load_file
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"experts\.5\.w2"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(d | {"sliding_window": "512"}))
    with pytest.raises(ConfigError, match="config.json: sliding_window"):
        load(tmp_path)
