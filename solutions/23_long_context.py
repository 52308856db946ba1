"""Reference solutions to lesson 23's exercises (notebooks/23_long_context.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""
import math

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hardway.models.llama import ModelConfig


def yarn_pair_of(turns: float, head_dim: int, base: float, original: int) -> float:
    """The (fractional) pair index that turns `turns` times in `original` positions: original·θ_i / 2π = turns,
    θ_i = base^(-2i/d), solved for i."""
    return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))


def yarn_split(head_dim: int, base: float, original: int, beta_fast: float = 32, beta_slow: float = 1) -> dict:
    """Pairs YaRN keeps (ramp 0: at or below the fast bound) and interpolates fully (ramp 1: at or past the slow
    bound). truncate (the default) rounds the bounds outwards."""
    low = max(math.floor(yarn_pair_of(beta_fast, head_dim, base, original)), 0)
    high = min(math.ceil(yarn_pair_of(beta_slow, head_dim, base, original)), head_dim - 1)
    return {"kept": list(range(0, low + 1)), "interpolated": list(range(high, head_dim // 2))}


# Exercise 1: Qwen2.5-7B-Instruct's YaRN (head_dim 128, theta 1e6, original 32768): bounds 23.6 -> 23 and 39.6 -> 40.
my_yarn_pairs = yarn_split(128, 1_000_000.0, 32768)


# Exercise 2: drive transformers' rotary embedding and the suspect through passes that tell the four mistakes apart.
def diagnose_dynamic(make_rope, trained: int = 64, factor: float = 4.0):
    """The letter of the mistake make_rope(config) has (None if it matches transformers on every probe)."""
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=trained,
                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": factor})
    config = ModelConfig.from_dict(hf.to_dict() | {"model_type": "llama"})
    x = torch.zeros(1)

    def run(passes):
        """(suspect, transformers, cos equal?) of the last pass, the same passes fed to fresh pairs."""
        suspect, theirs = make_rope(config), LlamaRotaryEmbedding(hf)
        for first, end in passes:
            positions = torch.arange(first, end)
            cos, _ = suspect(positions, torch.float32)
            ref_cos, _ = theirs(x, positions[None])
        return suspect, cos, ref_cos[0]

    _, cos, ref = run([(0, 2 * trained)])
    if not torch.equal(cos, ref):
        return "A"  # one pass from 0 differs: the factor on cos and sin (for 'dynamic' it is 1, so never this one)
    _, cos, ref = run([(0, 2 * trained), (0, trained // 2)])
    if not torch.equal(cos, ref):
        return "D"  # a short pass after a long one kept the stretch
    _, cos, ref = run([(0, 2 * trained), (2 * trained, 2 * trained + 1)])
    if not torch.equal(cos, ref):
        angle = torch.tensor([2 * trained]).float()[:, None] * config_plain_inv_freq(config)  # (1, d/2)
        plain = torch.cat((angle, angle), dim=-1).cos()
        return "C" if torch.equal(cos, plain) else "B"  # one token counted as the length: back to plain
    return None


def config_plain_inv_freq(config):
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


my_rope_diagnosis = "B"  # diagnose_dynamic(planted_dynamic_rope) says so


# Exercise 3: pair 0's frequency is 1, so its angle is the position itself. bf16 keeps 8 significant bits (7 stored
# and the implicit 1): between 2^e and 2^(e+1) its numbers are 2^(e-7) apart, and rounding to the nearest is off by
# at most half of that. The largest position is m - 1; an integer that far from a bf16 number exists whenever e >= 8.
def my_bf16_angle_error(m: int) -> float:
    e = math.floor(math.log2(m - 1))  # the exponent of the largest position
    return 2.0 ** (e - 8) if e >= 8 else 0.0
