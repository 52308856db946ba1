"""Multi-head latent attention (MLA, DeepSeek-V2 and V3): each token's keys and values are cached as one small latent
vector and one shared rotated key, and expanded (or never expanded: the absorbed form) when a query reads them.

Written to match transformers' DeepseekV3Attention in fp32 (see notebooks/29_latent_attention.ipynb). Lesson 09 gives
the RMSNorm and RoPE; lesson 08's KVCache is what LatentCache specialises.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hardway.models.gpt2 import causal_mask
from hardway.models.kv_cache import KVCache, KVCacheFullError
from hardway.models.llama import RMSNorm, apply_rope

DECODE_FORMS = ("naive", "absorbed")  # how a one-token step reads the latents (LatentAttention.decode_form)


def rope_deinterleaved(x, cos, sin, interleave: bool):
    """RoPE on the last dim of x (..., T, d_rope). DeepSeek's weights pair dimensions (2i, 2i+1) (`rope_interleave`);
    transformers takes the even ones, then the odd ones, and rotates the halves as lesson 09 does: the output is in
    the half-split layout. Queries and keys both leave here in that layout, so their dot products are DeepSeek's."""
    if interleave:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)  # (..., T, d_rope): evens, then odds
    return apply_rope(x, cos, sin)


def attention_mask_for(mask, T: int, S: int, start_pos, every_slot: bool, device):
    """The boolean mask that says everything for T queries over S keys, or None where none is needed (a whole prompt
    uses is_causal; one new token sees every key): a batch's (B, 1, T, S) as given, or causal_mask's (T, S)."""
    if mask is not None:
        return mask
    if every_slot:  # lesson 12's static cache: its slots after the queries are empty
        return causal_mask(T, S, device=device, start_pos=start_pos)  # (T, S)
    if T == 1 or T == S:
        return None
    return causal_mask(T, S, device=device)  # (T, S): T new queries after S - T cached keys


class LatentAttention(nn.Module):
    """DeepSeek's attention. Per token and layer it caches c_kv (kv_lora_rank numbers, after kv_a_layernorm) and k_rope
    (qk_rope_head_dim numbers, rotated), one for all heads. Head h's key is [W_UK_h c_kv, k_rope], its value W_UV_h c_kv,
    where kv_b_proj's rows hold W_UK_h (qk_nope_head_dim rows) then W_UV_h (v_head_dim rows) for each head in turn.

    The query: q_proj, or (q_lora_rank set) a compression q_a_proj, an RMSNorm, q_b_proj; split per head into q_nope
    (qk_nope_head_dim) and q_rope (qk_rope_head_dim, rotated). `decode_form` chooses how a one-token step reads the
    latents: "naive" expands every cached latent to keys and values through kv_b_proj, "absorbed" folds W_UK into the
    query and W_UV into the output and attends in the latent space. A pass of several tokens is always naive."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx  # our slot in the cache
        C, H = config.hidden_size, config.num_attention_heads
        self.n_head, self.q_lora_rank, self.kv_lora_rank = H, config.q_lora_rank, config.kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.interleave, self.scale = config.rope_interleave, config.softmax_scale
        d_qk = self.d_nope + self.d_rope
        bias = config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(C, H * d_qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(C, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # transformers' default ε here, not rms_norm_eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * d_qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(C, self.kv_lora_rank + self.d_rope, bias=bias)  # the latent, the rope key
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(H * self.d_v, C, bias=bias)
        self.decode_form = "absorbed"  # benchmarks/mla.py: faster from a few hundred positions on

    def query(self, x, cos, sin):  # x: (B, T, C)
        """q_nope (B, H, T, d_nope) and the rotated q_rope (B, H, T, d_rope)."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.n_head, self.d_nope + self.d_rope).transpose(1, 2)  # (B, H, T, d_nope + d_rope)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        return q_nope, rope_deinterleaved(q_rope, cos, sin, self.interleave)

    def latent(self, x, cos, sin):  # x: (B, T, C)
        """What the cache keeps of each token: [c_kv (normed), k_rope (rotated)], (B, 1, T, kv_lora_rank + d_rope),
        one "head" shared by every query head."""
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.d_rope], dim=-1)  # (B, T, r), (B, T, d_rope)
        k_rope = rope_deinterleaved(k_rope[:, None], cos, sin, self.interleave)  # (B, 1, T, d_rope)
        return torch.cat((self.kv_a_layernorm(c_kv)[:, None], k_rope), dim=-1)  # (B, 1, T, r + d_rope)

    def expand(self, kv):  # kv: (B, 1, S, r + d_rope), the cached latents
        """The naive form's keys (B, H, S, d_nope + d_rope) and values (B, H, S, d_v): every latent through kv_b_proj."""
        B, _, S, _ = kv.shape
        c_kv, k_rope = kv[:, 0].split([self.kv_lora_rank, self.d_rope], dim=-1)  # (B, S, r), (B, S, d_rope)
        kv_heads = self.kv_b_proj(c_kv).view(B, S, self.n_head, self.d_nope + self.d_v).transpose(1, 2)
        k_nope, v = kv_heads.split([self.d_nope, self.d_v], dim=-1)  # (B, H, S, d_nope), (B, H, S, d_v)
        k = torch.cat((k_nope, k_rope[:, None].expand(B, self.n_head, S, self.d_rope)), dim=-1)  # (B, H, S, d_qk)
        return k, v

    def attend_naive(self, q_nope, q_rope, kv, mask):  # q_*: (B, H, T, d_*); kv: (B, 1, S, r + d_rope)
        k, v = self.expand(kv)  # (B, H, S, d_nope + d_rope), (B, H, S, d_v)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, T, d_nope + d_rope)
        T, S = q.shape[2], k.shape[2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T == S and T > 1,
                                              scale=self.scale)  # (B, H, T, d_v)

    def absorbed_weights(self):
        """kv_b_proj's weight as W_UK (H, d_nope, r) and W_UV (H, d_v, r)."""
        w = self.kv_b_proj.weight.view(self.n_head, self.d_nope + self.d_v, self.kv_lora_rank)  # (H, d_nope + d_v, r)
        return w[:, :self.d_nope], w[:, self.d_nope:]

    def attend_absorbed(self, q_nope, q_rope, kv, mask):  # q_*: (B, H, T, d_*); kv: (B, 1, S, r + d_rope)
        """scores = (q_nope W_UK) c_kvᵀ + q_rope k_ropeᵀ: one attention of H·T queries over one shared head of
        keys [c_kv, k_rope] and values c_kv, in the latent space; W_UV applied to the H outputs after the sum."""
        B, H, T, _ = q_nope.shape
        S = kv.shape[2]
        w_uk, w_uv = self.absorbed_weights()  # (H, d_nope, r), (H, d_v, r)
        q_latent = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)  # (B, H, T, r): W_UK folded into the query
        q = torch.cat((q_latent, q_rope), dim=-1).reshape(B, 1, H * T, -1)  # (B, 1, H·T, r + d_rope): row h·T + t
        if mask is None and T > 1:  # the queries of every head share one causal pattern
            mask = causal_mask(T, S, device=kv.device)  # (T, S)
        if mask is not None and T > 1:
            mask = mask.repeat(*([1] * (mask.dim() - 2)), H, 1)  # (..., H·T, S), rows in q's order
        o = F.scaled_dot_product_attention(q, kv, kv[..., :self.kv_lora_rank], attn_mask=mask,
                                           scale=self.scale)  # (B, 1, H·T, r): a mix of latents per query
        return torch.einsum("bhtr,hvr->bhtv", o.view(B, H, T, -1), w_uv)  # (B, H, T, d_v): W_UV after the mix

    def forward(self, x, cos, sin, kv_cache=None, start_pos=0, mask=None):  # x: (B, T, C)
        B, T, _ = x.shape
        q_nope, q_rope = self.query(x, cos, sin)  # (B, H, T, d_nope), (B, H, T, d_rope)
        kv = self.latent(x, cos, sin)  # (B, 1, T, r + d_rope)
        if kv_cache is not None:  # a LatentCache keeps the latent once; a cache of keys and values keeps it as both
            kv, _ = kv_cache.update(self.layer_idx, start_pos, kv, kv)  # (B, 1, S, r + d_rope)
        mask = attention_mask_for(mask, T, kv.shape[2], start_pos, getattr(kv_cache, "returns_every_slot", False),
                                  x.device)
        absorbed = T == 1 and self.decode_form == "absorbed"
        y = (self.attend_absorbed if absorbed else self.attend_naive)(q_nope, q_rope, kv, mask)  # (B, H, T, d_v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.d_v))  # (B, T, C)


class LatentCache(KVCache):
    """Lesson 08's KVCache for latent attention: per layer, row and position, the latent c_kv and the rotated key
    k_rope, side by side in `k` (n_layers, B, 1, max_len, kv_lora_rank + d_rope); no values (`v` is None): each
    query head's key and value are computed from the latent. `update(layer, start_pos, kv, v)` writes kv (B, 1, T,
    kv_lora_rank + d_rope), ignores v (the model passes kv again, for caches that keep keys and values) and returns
    (the latents of positions [0, start_pos + T), None). Its layers are the model's layers, one to one."""

    def __init__(self, n_layers: int, batch_size: int, max_len: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__(n_layers, batch_size, max_len, 1, kv_lora_rank + rope_dim, dtype, device="meta")  # checks
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.k = torch.zeros(n_layers, batch_size, 1, max_len, kv_lora_rank + rope_dim, dtype=dtype,
                             device=device)  # (n_layers, B, 1, max_len, r + d_rope)
        self.v = None

    def update(self, layer_idx: int, start_pos, k: torch.Tensor, v: torch.Tensor | None = None):
        expected = (self.batch_size, 1, k.shape[2] if k.dim() == 4 else -1, self.head_dim)
        if tuple(k.shape) != expected:
            raise ValueError(f"LatentCache.update: kv {tuple(k.shape)} must be (B={self.batch_size}, 1, T, "
                             f"kv_lora_rank + rope_dim={self.head_dim})")
        start = int(start_pos)
        end = start + k.shape[2]
        if start < 0 or end > self.max_len:
            raise KVCacheFullError(f"LatentCache holds {self.max_len} positions; writing {k.shape[2]} token(s) at "
                                   f"start_pos {start} needs positions up to {end}. Allocate a larger cache.")
        self.k[layer_idx, :, :, start:end] = k  # in place
        return self.k[layer_idx, :, :, :end], None  # (B, 1, end, r + d_rope)

    @property
    def bytes_per_token(self) -> int:
        """One position over every layer and row: kv_lora_rank + rope_dim numbers a layer, whatever the heads."""
        return self.batch_size * self.n_layers * self.head_dim * self.k.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes
