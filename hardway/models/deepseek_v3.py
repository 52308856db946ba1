"""DeepSeek-V3 (and its MLA + MoE layout): latent attention (models/latent_attention.py) in every layer, a dense MLP in
the first `first_k_dense_replace` layers, then a mixture of routed experts chosen by sigmoid scores in groups, beside
shared experts that every token runs through.

Written to match transformers' DeepseekV3ForCausalLM in fp32 (see notebooks/29_latent_attention.ipynb). Lesson 09
gives the plumbing (Llama's forward pass, the MLP, RoPE), lesson 21 the experts and their dispatch.

    model = hardway.load(folder)  # a folder whose config.json says "model_type": "deepseek_v3"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hardway.contract import Checkpoint, shapes_only
from hardway.errors import ConfigError, check_int, check_number
from hardway.models.latent_attention import DECODE_FORMS, LatentAttention, LatentCache
from hardway.models.llama import MLP, Llama, ModelConfig, RMSNorm, RotaryEmbedding, assign_weights
from hardway.models.moe import Experts, dispatch, gathered_experts, stack_experts
from hardway.models.rope_scaling import yarn_mscale

ROPE_TYPES = ("default", "yarn")  # what DeepSeek ships (yarn, with its softmax mscale) and plain RoPE


@dataclass
class DeepseekV3Config(ModelConfig):
    """Lesson 09's ModelConfig (head_dim is the rotated part, qk_rope_head_dim, for RotaryEmbedding) and MLA's and
    the experts' sizes."""
    q_lora_rank: int | None = 1536      # the query's compression (None: one q_proj)
    kv_lora_rank: int = 512             # r: the latent each token caches per layer
    qk_nope_head_dim: int = 128         # a head's key/query dimensions without position
    qk_rope_head_dim: int = 64          # the rotated ones, one key for all heads
    v_head_dim: int = 128
    rope_interleave: bool = True        # the checkpoint pairs rotated dimensions (2i, 2i+1)
    softmax_scale: float = 0.0          # (d_nope + d_rope)^-1/2, times yarn's mscale² where the config asks for it
    num_experts: int = 256              # routed experts (n_routed_experts)
    n_shared_experts: int = 1           # shared experts, run by every token as one MLP of n × moe_intermediate_size
    moe_intermediate_size: int = 2048
    num_experts_per_tok: int = 8
    n_group: int = 8                    # experts are chosen from topk_group of n_group groups
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    sparse_layers: tuple = ()           # per layer: True = experts, False = a dense MLP


def deepseek_v3_config(d: dict) -> DeepseekV3Config:
    """A DeepseekV3Config from a config.json dict (model_type "deepseek_v3"), transformers' defaults where a key is
    absent. What this course does not implement (fp8 weights, other RoPE kinds, other MoE layouts) is a ConfigError."""
    if d.get("model_type") != "deepseek_v3":
        raise ConfigError(f"model_type {d.get('model_type')!r} is not 'deepseek_v3'")
    if d.get("quantization_config"):
        raise ConfigError(f"quantization_config {d['quantization_config'].get('quant_method', '?')!r}: DeepSeek's fp8 "
                          f"block weights are not read here; convert the checkpoint to bf16 first")
    d = {**dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                num_attention_heads=128, max_position_embeddings=4096), **d}

    def size(key, default, minimum=1):
        value = d.get(key, default)
        return default if value is None else check_int(key, value, minimum=minimum, error=ConfigError)

    rope_dim, nope_dim = size("qk_rope_head_dim", 64), size("qk_nope_head_dim", 128)
    if rope_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={rope_dim} is odd: RoPE rotates pairs of dimensions")
    heads = check_int("num_attention_heads", d["num_attention_heads"], minimum=1, error=ConfigError)
    if d.get("num_key_value_heads") not in (None, heads):
        raise ConfigError(f"num_key_value_heads={d['num_key_value_heads']} != num_attention_heads={heads}: latent "
                          f"attention gives every query head its own key and value")
    base = ModelConfig.from_dict({**d, "model_type": "llama", "head_dim": rope_dim, "num_key_value_heads": heads,
                                  "attention_bias": False, "mlp_bias": False})
    rope_type = (base.rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not implemented for deepseek_v3 (only {list(ROPE_TYPES)})")
    scale = (nope_dim + rope_dim) ** -0.5
    if rope_type != "default" and base.rope_scaling.get("mscale_all_dim"):  # DeepSeek's yarn: softmax sharpened too
        scale *= yarn_mscale(base.rope_scaling["factor"], base.rope_scaling["mscale_all_dim"]) ** 2
    q_rank = d.get("q_lora_rank", 1536)
    n_experts = size("n_routed_experts", 256)
    n_group, topk_group, k = size("n_group", 8), size("topk_group", 4), size("num_experts_per_tok", 8)
    if n_experts % n_group or n_experts // n_group < 2:
        raise ConfigError(f"n_routed_experts={n_experts} must split into n_group={n_group} groups of 2 or more "
                          f"(a group's score is the sum of its best two)")
    if topk_group > n_group or k > topk_group * (n_experts // n_group):
        raise ConfigError(f"num_experts_per_tok={k} from topk_group={topk_group} of n_group={n_group} groups of "
                          f"{n_experts // n_group} experts does not fit")
    if size("moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq={d['moe_layer_freq']}: only 1 (every layer after the dense ones has "
                          f"experts, as transformers builds it) is implemented")
    dense = size("first_k_dense_replace", 3, minimum=0)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    return DeepseekV3Config(
        **{**fields, "model_type": "deepseek_v3", "attention_bias": bool(d.get("attention_bias", False))},
        q_lora_rank=None if q_rank is None else check_int("q_lora_rank", q_rank, minimum=1, error=ConfigError),
        kv_lora_rank=size("kv_lora_rank", 512), qk_nope_head_dim=nope_dim, qk_rope_head_dim=rope_dim,
        v_head_dim=size("v_head_dim", 128), rope_interleave=bool(d.get("rope_interleave", True)), softmax_scale=scale,
        num_experts=n_experts, n_shared_experts=size("n_shared_experts", 1),
        moe_intermediate_size=size("moe_intermediate_size", 2048), num_experts_per_tok=k, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=check_number("routed_scaling_factor", d.get("routed_scaling_factor", 2.5),
                                           positive=True, error=ConfigError),
        sparse_layers=tuple(i >= dense for i in range(base.num_hidden_layers)))


class GroupRouter(nn.Module):
    """DeepSeek-V3's gate: a sigmoid score per expert; the choice adds a learnt bias (e_score_correction_bias, which
    balances the experts' load) and keeps only the topk_group groups whose two best biased scores sum highest; the
    weights are the chosen experts' unbiased scores, divided by their sum (norm_topk_prob), times
    routed_scaling_factor."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.renormalise, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))  # (E, C)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)  # (E,)

    def forward(self, x):  # x: (N, C)
        """(weights (N, k) fp32, experts (N, k) int64)."""
        N = x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (N, E) fp32, as transformers
        biased = scores + self.e_score_correction_bias.float()  # (N, E): for choosing only
        groups = biased.view(N, self.n_group, -1)  # (N, G, E / G)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # (N, G): each group's best two
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(self.topk_group, dim=-1, sorted=False).indices, True)  # (N, G)
        biased = groups.masked_fill(~keep[..., None], float("-inf")).view(N, -1)  # (N, E): other groups out
        experts = biased.topk(self.k, dim=-1, sorted=False).indices  # (N, k)
        weights = scores.gather(1, experts)  # (N, k): the unbiased scores
        if self.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class DeepSeekMoE(nn.Module):
    """Routed experts (lesson 21's Experts and dispatch, DeepSeek's gate) plus the shared experts, one MLP."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.n_experts = config.num_experts
        self.gate = GroupRouter(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(dataclasses.replace(
            config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts))

    def forward(self, x):  # x: (B, T, C)
        B, T, C = x.shape
        rows = x.reshape(B * T, C)  # (N, C)
        weights, chosen = self.gate(rows)  # (N, k) each
        if torch.compiler.is_compiling():  # lesson 12's compiled step: no loop over the routing's values
            routed = gathered_experts(self.experts, rows, weights, chosen)  # (N, C) fp32
        else:
            routed = dispatch(rows, weights, chosen, self.experts.expert, self.n_experts)  # (N, C) fp32
        return routed.to(x.dtype).view(B, T, C) + self.shared_experts(x)  # (B, T, C)


class DeepseekV3Block(nn.Module):
    """Norm, latent attention, residual; norm, a dense MLP or DeepSeekMoE, residual."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = LatentAttention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DeepSeekMoE(config) if config.sparse_layers[layer_idx] else MLP(config)

    def forward(self, x, cos, sin, kv_cache=None, start_pos=0, mask=None):  # x: (B, T, C)
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_cache, start_pos, mask)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class DeepseekV3(Llama):
    """DeepSeek-V3: embeddings, DeepseekV3Blocks, a final RMSNorm, the head. Lesson 09's Llama gives the forward pass
    (its blocks take the same arguments), max_seq_len, eos_token_ids and moves; the cache is a LatentCache.

    `decode_form` ("absorbed" or "naive") is how every layer's one-token steps read the latents (LatentAttention)."""

    def __init__(self, config: DeepseekV3Config):
        nn.Module.__init__(self)
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rope = RotaryEmbedding(config)  # config.head_dim is qk_rope_head_dim: only that part turns
        self.blocks = nn.ModuleList(DeepseekV3Block(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.sliding_windows = (None,) * config.num_hidden_layers

    @property
    def decode_form(self) -> str:
        return self.blocks[0].attn.decode_form

    @decode_form.setter
    def decode_form(self, form: str) -> None:
        if form not in DECODE_FORMS:
            raise ValueError(f"decode_form must be one of {DECODE_FORMS}, got {form!r}")
        for block in self.blocks:
            block.attn.decode_form = form

    def qkv(self, layer: int, x):
        """Layer `layer`'s per-head q (B, H, T, d_nope + d_rope), k (the same) and v (B, H, T, d_v), expanded from
        the latents as the naive form does, for the stream x (B, T, C) entering it at 0..T-1."""
        attn, h = self.blocks[layer].attn, self.blocks[layer].attn_norm(x)
        cos, sin = self.rope(torch.arange(x.shape[1], device=x.device), x.dtype)  # (T, d_rope) each
        q_nope, q_rope = attn.query(h, cos, sin)
        k, v = attn.expand(attn.latent(h, cos, sin))
        return torch.cat((q_nope, q_rope), dim=-1), k, v

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> LatentCache:
        """A LatentCache: per layer and position, kv_lora_rank + qk_rope_head_dim numbers, in our dtype and device."""
        max_len = self.max_seq_len if max_len is None else max_len
        if max_len > self.max_seq_len:
            raise ValueError(f"max_len={max_len} is longer than this model's max_seq_len={self.max_seq_len}")
        c, w = self.config, self.tok_emb.weight
        return LatentCache(c.num_hidden_layers, batch_size, max_len, c.kv_lora_rank, c.qk_rope_head_dim, w.dtype,
                           w.device)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint) -> "DeepseekV3":
        config = deepseek_v3_config(checkpoint.config)
        config.eos_token_ids = checkpoint.eos_token_ids
        with shapes_only():
            model = cls(config)
        n = config.num_hidden_layers  # the hub's files add multi-token-prediction layers after the last: not run
        tensors = {k: v for k, v in checkpoint.tensors.items()
                   if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
        model = assign_weights(model, stack_experts(tensors, config), deepseek_v3_names(config))
        model.rope = RotaryEmbedding(config, device=model.tok_emb.weight.device)
        return model.eval()


def deepseek_v3_names(config: DeepseekV3Config) -> dict[str, str]:
    """{hub name (experts stacked, lesson 21): our name} for every tensor of a DeepseekV3ForCausalLM checkpoint."""
    names = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "final_norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    attention = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    attention += ["q_proj.weight"] if config.q_lora_rank is None else \
        ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
    if config.attention_bias:
        attention += ["kv_a_proj_with_mqa.bias", "o_proj.bias"] + ([] if config.q_lora_rank is None else
                                                                  ["q_a_proj.bias"])
    shared = [f"shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    for i, sparse in enumerate(config.sparse_layers):
        hub, ours = f"model.layers.{i}.", f"blocks.{i}."
        names[hub + "input_layernorm.weight"] = ours + "attn_norm.weight"
        names[hub + "post_attention_layernorm.weight"] = ours + "mlp_norm.weight"
        for name in attention:
            names[hub + "self_attn." + name] = ours + "attn." + name
        mlp = (["gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj", *shared]
               if sparse else [f"{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")])
        for name in mlp:
            names[hub + "mlp." + name] = ours + "mlp." + name
    return names
