"""gpt-oss (OpenAI, 2025): attention with a learned sink per head, sliding-window layers alternating with full ones,
biases on q/k/v/o, YaRN RoPE, and a mixture of experts whose router keeps k logits before its softmax and whose
experts run a clamped SwiGLU. The experts ship in MXFP4 (formats/mxfp4.py).

Written to match transformers' GptOssForCausalLM in fp32 (see notebooks/31_sinks_and_mxfp4.ipynb).

    model = hardway.load(folder)  # a folder whose config.json says "model_type": "gpt_oss"
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from hardway.contract import Checkpoint, shapes_only
from hardway.errors import CheckpointError, ConfigError, check_int, check_number
from hardway.formats.mxfp4 import BLOCK, dequantize_openai, mxfp4_matmul, openai_to_ggml  # this lesson
from hardway.models.gemma3 import LAYER_TYPES, RopeSettings, layer_mask  # lesson 20
from hardway.models.gpt2 import causal_mask
from hardway.models.llama import Attention, Llama, RMSNorm, RotaryEmbedding, assign_weights, repeat_kv
from hardway.models.moe import dispatch  # lesson 21
from hardway.models.rope_scaling import context_length, read_rope_config  # lesson 23


@dataclass
class GptOssConfig:
    vocab_size: int
    hidden_size: int                # C
    intermediate_size: int          # H: the hidden width of one expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int    # the positions it may run
    layer_types: tuple[str, ...]    # per layer: "full_attention" or "sliding_attention"
    sliding_window: int             # W: a sliding layer's query sees itself and the W - 1 positions before it
    num_local_experts: int          # E
    num_experts_per_tok: int        # k
    rope_theta: float = 150_000.0
    rope_scaling: dict | None = None  # lesson 23's dict; gpt-oss ships YaRN, factor 32 over 4,096 positions
    trained_positions: int = 131_072  # config.json's max_position_embeddings, what YaRN's functions read
    swiglu_alpha: float = 1.702     # the sigmoid's gain: gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0       # gate clamped above at +limit, up clamped to [-limit, limit]
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    model_type: str = "gpt_oss"
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer: None for full attention, W for a sliding layer (what lesson 15's engine reads)."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @classmethod
    def from_dict(cls, d: dict) -> "GptOssConfig":
        """A gpt_oss config.json dict (transformers 5's rope_parameters or the hub's rope_scaling); transformers'
        defaults for absent keys; what we do not implement refused in one line."""
        if d.get("model_type") != "gpt_oss":
            raise ConfigError(f"model_type {d.get('model_type')!r} is not 'gpt_oss'")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"missing {missing}: a gpt_oss model needs {list(required)}")
        size = {k: check_int(k, d[k], minimum=1, error=ConfigError) for k in required}
        n_heads, n_layers = size["num_attention_heads"], size["num_hidden_layers"]

        def optional_int(key, default):
            return default if d.get(key) is None else check_int(key, d[key], minimum=1, error=ConfigError)

        def optional_number(key, default):
            return default if d.get(key) is None else check_number(key, d[key], positive=True, error=ConfigError)

        if d.get("attention_bias") is False:  # every gpt-oss checkpoint has them; transformers' Experts always do
            raise ConfigError("attention_bias=false: gpt-oss's attention has q/k/v/o biases, and only that is implemented")
        method = (d.get("quantization_config") or {}).get("quant_method", "mxfp4")
        if method != "mxfp4":
            raise ConfigError(f"quantization_config.quant_method {method!r}: a gpt_oss checkpoint is read in MXFP4 or "
                              f"unquantized")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d['hidden_act']!r}: gpt-oss's experts run a clamped SwiGLU ('silu')")
        layer_types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                               for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise ConfigError(f"layer_types must list one type for each of the {n_layers} layers, got {layer_types!r}")
        unknown = sorted({str(t) for t in layer_types} - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"layer_types has {unknown}: an attention variant gpt_oss does not have; each layer is "
                              f"one of {LAYER_TYPES}")
        head_dim = optional_int("head_dim", size["hidden_size"] // n_heads)
        if head_dim % 2:
            raise ConfigError(f"head_dim={head_dim} is odd: RoPE rotates pairs of dimensions")
        n_kv = optional_int("num_key_value_heads", n_heads)
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        n_experts = optional_int("num_local_experts", 128)
        k = optional_int("num_experts_per_tok", 4)
        if k > n_experts:
            raise ConfigError(f"num_experts_per_tok={k} is more than the {n_experts} experts there are")
        window = d.get("sliding_window", 128)
        if window is None and "sliding_attention" in layer_types:
            raise ConfigError("sliding_window is null, but layer_types has sliding_attention layers")
        trained = optional_int("max_position_embeddings", 131_072)
        theta, scaling = read_rope_config(d, trained, head_dim, default_theta=150_000.0)
        if scaling is not None and scaling["rope_type"] in ("dynamic", "longrope"):
            # transformers recomputes these from the length seen so far; gpt-oss ships YaRN, which does not
            raise ConfigError(f"rope_type {scaling['rope_type']!r}: gpt_oss here runs 'default', 'linear', 'yarn' "
                              f"or 'llama3' RoPE")
        return cls(**size, num_key_value_heads=n_kv, head_dim=head_dim,
                   max_position_embeddings=context_length(trained, scaling), layer_types=tuple(layer_types),
                   sliding_window=None if window is None else check_int("sliding_window", window, minimum=1,
                                                                        error=ConfigError),
                   num_local_experts=n_experts, num_experts_per_tok=k, rope_theta=theta, rope_scaling=scaling,
                   trained_positions=trained, swiglu_alpha=optional_number("swiglu_alpha", 1.702),
                   swiglu_limit=optional_number("swiglu_limit", 7.0), rms_norm_eps=optional_number("rms_norm_eps", 1e-5),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))


def sink_attention(q, k, v, sinks, mask, scale: float):
    """Attention whose softmax has one more logit per head, the sink, that belongs to no key: a head may put
    probability on "nothing" instead of being forced to spread all of it over the keys.

    q (B, n_head, T, d); k, v (B, n_kv_head, S, d); sinks (n_head,); mask None (causal, the T queries the last T of
    S positions) or boolean (T, S) or (B, 1, T, S), True = may attend. Written out as transformers' eager path
    writes it: the scores, the sink column appended, the row's maximum subtracted, softmax, the sink's column
    dropped. A query whose keys are all masked (a padding row) puts everything on the sink: zeros, not NaN."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    n_rep = H // k.shape[1]
    scores = q @ repeat_kv(k, n_rep).transpose(2, 3) * scale  # (B, n_head, T, S)
    if mask is None and T > 1:
        mask = causal_mask(T, S, device=q.device)  # (T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # (B, n_head, T, S)
    sink = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)  # (B, n_head, T, 1)
    logits = torch.cat([scores, sink], dim=-1)  # (B, n_head, T, S + 1)
    logits = logits - logits.amax(dim=-1, keepdim=True)  # the sink is finite: no row is all -inf
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # (B, n_head, T, S): what the keys get; the rest went to the sink
    return probs.to(v.dtype) @ repeat_kv(v, n_rep)  # (B, n_head, T, d)


class SinkAttention(Attention):
    """Lesson 09's attention (biases on q, k, v and o) under lesson 20's sliding window on its sliding layers, with a
    learned sink logit per query head."""

    def __init__(self, config: GptOssConfig, layer_idx: int = 0):
        nn.Module.__init__(self)
        self.layer_idx = layer_idx
        C, d = config.hidden_size, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(C, self.n_head * d)
        self.k_proj = nn.Linear(C, self.n_kv_head * d)
        self.v_proj = nn.Linear(C, self.n_kv_head * d)
        self.o_proj = nn.Linear(self.n_head * d, C)
        self.sinks = nn.Parameter(torch.empty(self.n_head))  # (n_head,): one logit each, learned
        self.sliding_window = config.sliding_windows[layer_idx]  # None: full attention

    def forward(self, x, cos, sin, kv_cache=None, start_pos=0, mask=None):  # x: (B, T, C)
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)  # (B, n_head, T, d), (B, n_kv_head, T, d) twice
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, start_pos, k, v)  # (B, n_kv_head, S, d)
        every_slot = getattr(kv_cache, "returns_every_slot", False)  # lesson 12's static cache: all its slots
        mask = layer_mask(mask, T, k.shape[2], start_pos, self.sliding_window, every_slot, x.device)
        y = sink_attention(q, k, v, self.sinks, mask, self.head_dim ** -0.5)  # (B, n_head, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))  # (B, T, C)


class Router(nn.Module):
    """A linear layer with a bias, from the residual stream to E logits. Each token keeps its k largest logits and
    the softmax runs over those k only (lesson 21's Mixtral took the softmax over all E, then the k largest)."""

    def __init__(self, config: GptOssConfig):
        super().__init__()
        self.k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size))  # (E, C)
        self.bias = nn.Parameter(torch.empty(config.num_local_experts))  # (E,)

    def forward(self, x):  # x: (N, C)
        logits = F.linear(x, self.weight, self.bias)  # (N, E)
        top, experts = torch.topk(logits, self.k, dim=-1)  # (N, k) each, largest first
        return torch.softmax(top, dim=-1), experts  # weights (N, k), each row sums to 1


def clamped_swiglu(gate_up, alpha: float, limit: float):
    """gate_up (..., 2H), gate and up interleaved as transformers stores them (column 2j is gate j, 2j + 1 is up j)
    -> (..., H): gate clamped above at `limit`, up to [-limit, limit], then (up + 1) · gate · sigmoid(alpha · gate)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # (..., H) each
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))  # (..., H)


class Experts(nn.Module):
    """E clamped-SwiGLU MLPs with biases, stored as transformers stores them: gate_up_proj (E, C, 2H), x @ it, gate
    and up columns interleaved; down_proj (E, H, C)."""

    def __init__(self, config: GptOssConfig):
        super().__init__()
        E, C, H = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(E, C, 2 * H))  # (E, C, 2H)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * H))  # (E, 2H)
        self.down_proj = nn.Parameter(torch.empty(E, H, C))  # (E, H, C)
        self.down_proj_bias = nn.Parameter(torch.empty(E, C))  # (E, C)

    def expert(self, e: int, x):  # x: (n, C), the tokens routed to expert e
        h = clamped_swiglu(x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e], self.alpha, self.limit)  # (n, H)
        return h @ self.down_proj[e] + self.down_proj_bias[e]  # (n, C)

    def gathered(self, x, weights, chosen):
        """Σ over each token's k experts with shapes known before the routing (lesson 21's, for a compiled step):
        each token's k experts' matrices gathered. x (N, C); weights, chosen (N, k) -> (N, C) fp32."""
        gate_up = torch.einsum("nc,nkch->nkh", x, self.gate_up_proj[chosen]) + self.gate_up_proj_bias[chosen]
        h = clamped_swiglu(gate_up, self.alpha, self.limit)  # (N, k, H)
        y = torch.einsum("nkh,nkhc->nkc", h, self.down_proj[chosen]) + self.down_proj_bias[chosen]  # (N, k, C)
        return (y.float() * weights[..., None].float()).sum(dim=1)  # (N, C)


class MXFP4Experts(nn.Module):
    """The same experts, their two matrices kept in MXFP4 as the checkpoint ships them (17 bytes per 32 weights,
    ggml's block layout: formats/mxfp4.py) and multiplied through mxfp4_matmul; the biases in the model's dtype.
    gate_up_blocks (E, 2H, C/32 · 17): row 2j is gate j, 2j + 1 up j; down_blocks (E, C, H/32 · 17)."""

    def __init__(self, gate_up_blocks, gate_up_bias, down_blocks, down_bias, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.register_buffer("gate_up_blocks", gate_up_blocks)  # (E, 2H, C/32 · 17) uint8
        self.register_buffer("down_blocks", down_blocks)  # (E, C, H/32 · 17) uint8
        self.gate_up_proj_bias = nn.Parameter(gate_up_bias, requires_grad=False)  # (E, 2H)
        self.down_proj_bias = nn.Parameter(down_bias, requires_grad=False)  # (E, C)

    def expert(self, e: int, x):  # x: (n, C)
        gate_up = mxfp4_matmul(x, self.gate_up_blocks[e]) + self.gate_up_proj_bias[e]  # (n, 2H)
        h = clamped_swiglu(gate_up, self.alpha, self.limit)  # (n, H)
        return mxfp4_matmul(h, self.down_blocks[e]) + self.down_proj_bias[e]  # (n, C)


class GptOssMoE(nn.Module):
    """Route each token, run its k experts (lesson 21's dispatch), add them weighted."""

    def __init__(self, config: GptOssConfig):
        super().__init__()
        self.n_experts = config.num_local_experts
        self.router = Router(config)
        self.experts = Experts(config)

    def forward(self, x):  # x: (B, T, C)
        B, T, C = x.shape
        rows = x.reshape(B * T, C)  # (N, C)
        weights, chosen = self.router(rows)  # (N, k) each
        if torch.compiler.is_compiling() and isinstance(self.experts, Experts):  # lesson 12: no data-dependent loop
            return self.experts.gathered(rows, weights, chosen).to(x.dtype).view(B, T, C)
        return dispatch(rows, weights, chosen, self.experts.expert, self.n_experts).to(x.dtype).view(B, T, C)


class GptOssBlock(nn.Module):
    def __init__(self, config: GptOssConfig, layer_idx: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = SinkAttention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMoE(config)

    def forward(self, x, cos, sin, kv_cache=None, start_pos=0, mask=None):  # x: (B, T, C)
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_cache, start_pos, mask)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


def rotary_embedding(config: GptOssConfig, device=None) -> RotaryEmbedding:
    """Lesson 09's RotaryEmbedding with lesson 23's scaling (YaRN for every gpt-oss checkpoint)."""
    return RotaryEmbedding(RopeSettings(config.head_dim, config.rope_theta, config.rope_scaling,
                                        config.trained_positions), device=device)


class GptOss(Llama):
    """gpt-oss. Lesson 09's Llama gives the plumbing (forward, max_seq_len, eos_token_ids, new_kv_cache, qkv, moves);
    the blocks are above. The KV cache is lesson 08's, one slot per layer: a sliding layer caches every position
    like a full one, and lesson 15's engine keeps its window only (`sliding_windows`)."""

    def __init__(self, config: GptOssConfig):
        nn.Module.__init__(self)
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rope = rotary_embedding(config)
        self.blocks = nn.ModuleList(GptOssBlock(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.sliding_windows = config.sliding_windows  # per layer: None (full attention) or W

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, mxfp4_blocks: bool = False) -> "GptOss":
        """A gpt-oss from a `Checkpoint` (lesson 06). Its experts either in the model's dtype (transformers' names),
        or in MXFP4 as openai ships them (`*_blocks` and `*_scales`), dequantized exactly as transformers
        dequantizes them; with mxfp4_blocks=True those stay MXFP4 (MXFP4Experts), multiplied as blocks."""
        config = GptOssConfig.from_dict(checkpoint.config)
        config.eos_token_ids = checkpoint.eos_token_ids
        tensors, blocks = split_mxfp4(checkpoint.tensors, config, keep=mxfp4_blocks)
        names = gpt_oss_names(config, experts=not blocks)
        with shapes_only():
            model = cls(config)
        biases = {}
        for i, block in enumerate(model.blocks if blocks else ()):
            del block.mlp.experts  # its matrices are blocks, not parameters: MXFP4Experts takes its place below
            biases[i] = [tensors.pop(f"model.layers.{i}.mlp.experts.{name}_bias", None) for name in ("gate_up_proj", "down_proj")]
        model = assign_weights(model, tensors, names)
        for i, (gate_up_bias, down_bias) in biases.items():
            if gate_up_bias is None or down_bias is None:
                raise CheckpointError(f"model.layers.{i}.mlp.experts: the experts' biases are missing")
            model.blocks[i].mlp.experts = MXFP4Experts(blocks[i][0], gate_up_bias, blocks[i][1], down_bias,
                                                       config.swiglu_alpha, config.swiglu_limit)
        model.rope = rotary_embedding(config, model.tok_emb.weight.device)  # fp32 frequencies, computed here
        return model.eval()


def gpt_oss_names(config: GptOssConfig, experts: bool = True) -> dict[str, str]:
    """{name in the checkpoint: name in our GptOss} for every tensor the config implies (the experts' four only
    where `experts`: an MXFP4Experts holds its own)."""
    names = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "final_norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(config.num_hidden_layers):
        hub, ours = f"model.layers.{i}.", f"blocks.{i}."
        names[hub + "input_layernorm.weight"] = ours + "attn_norm.weight"
        names[hub + "post_attention_layernorm.weight"] = ours + "mlp_norm.weight"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for kind in ("weight", "bias"):
                names[hub + f"self_attn.{proj}.{kind}"] = ours + f"attn.{proj}.{kind}"
        names[hub + "self_attn.sinks"] = ours + "attn.sinks"
        for kind in ("weight", "bias"):
            names[hub + f"mlp.router.{kind}"] = ours + f"mlp.router.{kind}"
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias") if experts else ():
            names[hub + f"mlp.experts.{name}"] = ours + f"mlp.experts.{name}"
    return names


def split_mxfp4(tensors: dict, config: GptOssConfig, keep: bool = False) -> tuple[dict, dict]:
    """The checkpoint's tensors with every expert matrix in MXFP4 (`<name>_blocks` (E, rows, n/32, 16) uint8 beside
    `<name>_scales` (E, rows, n/32) uint8, openai's layout) dequantized to transformers' layout and dtype; or, with
    `keep`, taken out and returned per layer as ggml blocks {layer: (gate_up (E, 2H, C/32 · 17), down (E, C, H/32 · 17))}.
    Half a pair, or blocks of the wrong shape: a CheckpointError naming the tensor."""
    out, kept = dict(tensors), {}
    dtype = tensors["model.embed_tokens.weight"].dtype if "model.embed_tokens.weight" in tensors else torch.float32
    E, C, H = config.num_local_experts, config.hidden_size, config.intermediate_size
    for i in range(config.num_hidden_layers):
        pair = []
        for name, (rows, n) in (("gate_up_proj", (2 * H, C)), ("down_proj", (C, H))):
            hub = f"model.layers.{i}.mlp.experts.{name}"
            has_blocks, has_scales = hub + "_blocks" in out, hub + "_scales" in out
            if not has_blocks and not has_scales:
                continue
            if not (has_blocks and has_scales):
                missing, present = (hub + "_scales", hub + "_blocks") if has_blocks else (hub + "_blocks", hub + "_scales")
                raise CheckpointError(f"{missing} is missing: MXFP4 needs both {present} and it")
            blocks, scales = out.pop(hub + "_blocks"), out.pop(hub + "_scales")
            expected = (E, rows, n // BLOCK, BLOCK // 2)
            if n % BLOCK or tuple(blocks.shape) != expected or tuple(scales.shape) != expected[:3]:
                raise CheckpointError(f"{hub}_blocks {tuple(blocks.shape)} and _scales {tuple(scales.shape)}: the "
                                      f"config implies {expected} and {expected[:3]} (blocks of {BLOCK} weights, "
                                      f"two 4-bit values a byte)")
            if keep:
                pair.append(openai_to_ggml(blocks, scales, what=hub))  # (E, rows, n/32 · 17)
            else:
                out[hub] = dequantize_openai(blocks, scales, dtype=dtype, what=hub).transpose(1, 2)  # (E, n, rows)
        if pair:
            if len(pair) != 2:
                raise CheckpointError(f"model.layers.{i}.mlp.experts: only one of gate_up_proj and down_proj is "
                                      f"in MXFP4; keeping blocks needs both")
            kept[i] = tuple(pair)
    if keep and kept and len(kept) != config.num_hidden_layers:
        raise CheckpointError(f"only layers {sorted(kept)} have MXFP4 experts; keeping blocks needs every layer's")
    return out, kept
