"""The sliding layers' pool, measured: KV bytes a sequence holds at 4,096 positions with and without it.

    uv run python benchmarks/sliding_kv.py                 # Gemma 3 270M's KV shapes, one sequence to 4,096 positions
    uv run python benchmarks/sliding_kv.py --positions 8192

A random model with Gemma 3 270M's attention shapes (18 layers, 1 KV head of 256, 4 query heads, five layers of
every six attending to a window of 512 positions, the sixth to all; fp32) and small everything else (the KV cache
does not depend on the rest). One greedy request whose prompt and answer reach --positions positions runs through
the engine twice: with the sliding layers' pool (lesson 15: their blocks go back as the window moves on), and with
sliding_pool=False (every layer keeps every position, lesson 14's one pool). At the step that computes the last
position it reads the blocks each pool holds, times the bytes of a block, and checks that both answers are
`hardway.generate`'s (lesson 08's cache, every position kept, the same window mask). Prints a table.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.nn as nn

from hardway.decode.generate import generate
from hardway.engine.engine import Engine
from hardway.engine.sequence import SamplingParams
from hardway.loading import load
from hardway.models.llama import Attention, causal_attention

N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, WINDOW, VOCAB = 18, 4, 1, 256, 512, 256


class WindowedAttention(Attention):
    """Lesson 09's attention whose query in column start_pos + t sees key column s only if s <= start_pos + t and
    start_pos + t - s < window (as Gemma 3's sliding layers)."""

    def __init__(self, attn: Attention, window: int):
        nn.Module.__init__(self)
        self.layer_idx, self.n_head, self.n_kv_head, self.head_dim = (attn.layer_idx, attn.n_head, attn.n_kv_head,
                                                                      attn.head_dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.window = window

    def forward(self, x, cos, sin, kv_cache=None, start_pos=0, mask=None):  # x: (B, T, C)
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)  # (B, n_head, T, d), (B, n_kv_head, T, d) x 2
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, start_pos, k, v)  # (B, n_kv_head, S, d)
        query = start_pos + torch.arange(T, device=x.device)[:, None]  # (T, 1)
        key = torch.arange(k.shape[2], device=x.device)[None, :]  # (1, S)
        window = (key <= query) & (query - key < self.window)  # (T, S)
        y = causal_attention(q, k, v, window if mask is None else mask & window)  # (B, n_head, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))  # (B, T, C)


def gemma3_270m_shaped(max_positions: int):
    """A seeded random Llama with Gemma 3 270M's KV shapes and its 5:1 pattern of sliding and full layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=N_LAYERS,
                         num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=max_positions, tie_word_embeddings=True)
    reference = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the default init, so that the logits are far from uniform
        for p in reference.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        model = load(folder)
    model.sliding_windows = tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(N_LAYERS))
    for block, window in zip(model.blocks, model.sliding_windows):
        if window is not None:
            block.attn = WindowedAttention(block.attn, window)
    return model


def run_engine(model, prompt, n_new, block_size, max_step_tokens, sliding_pool) -> dict:
    """One request through an engine -> its tokens, and the blocks each pool held at the last step."""
    n_blocks = math.ceil((len(prompt) + n_new) / block_size)
    engine = Engine(model, SimpleNamespace(decoder={i: bytes([65 + i % 26]) for i in range(VOCAB)}),
                    n_blocks=n_blocks, block_size=block_size, max_batch=1, max_step_tokens=max_step_tokens,
                    sliding_pool=sliding_pool)
    held = {}
    forward = engine.runner.forward

    def counting_forward(seqs, n_new_each):  # the pools' blocks as this step computes them
        seq, n = seqs[0], n_new_each[0]
        sliding = engine.sliding_blocks
        held.update(positions=seq.n_cached + n, full=engine.blocks.n_blocks - engine.blocks.n_free,
                    sliding=0 if sliding is None else sliding.n_blocks - sliding.n_free)
        return forward(seqs, n_new_each)

    engine.runner.forward = counting_forward
    start = time.perf_counter()
    seq = engine.add(prompt, SamplingParams(max_tokens=n_new, temperature=0, stop_token_ids=[]))
    while engine.has_work():
        engine.step()
    cache = engine.runner.cache
    held["bytes"] = held["full"] * cache.bytes_per_block() + held["sliding"] * cache.bytes_per_block(sliding=True)
    held.update(tokens=seq.output_ids, seconds=time.perf_counter() - start,
                pool_bytes=sum(t.numel() * t.element_size() for t in cache.k + cache.v))
    return held


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=4096, help="positions the sequence reaches (4096)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated after the prompt (16)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-step-tokens", type=int, default=512, help="the longest prefill chunk per step")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model = gemma3_270m_shaped(args.positions + 1)  # room for the last token picked
    prompt_len = args.positions - args.new_tokens + 1  # the last token picked is never computed
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = generate(model, torch.tensor([prompt]), max_new_tokens=args.new_tokens,
                         eos_token_id=None)[0, prompt_len:].tolist()
    runs = {"sliding layers' pool (lesson 15)": run_engine(model, prompt, args.new_tokens, args.block_size,
                                                           args.max_step_tokens, sliding_pool=True),
            "one pool, every position kept": run_engine(model, prompt, args.new_tokens, args.block_size,
                                                        args.max_step_tokens, sliding_pool=False)}
    print(f"Gemma 3 270M's KV shapes: {N_LAYERS} layers (5 of every 6 sliding, window {WINDOW}), {N_KV_HEADS} KV "
          f"head of {HEAD_DIM}, fp32, blocks of {args.block_size}; one sequence of {prompt_len} prompt tokens + "
          f"{args.new_tokens} new")
    print(f"{'cache':34s} {'positions':>9s} {'full-layer blocks':>17s} {'sliding blocks':>14s} "
          f"{'KV bytes held':>14s} {'MiB':>8s} {'pools allocated MiB':>19s} {'= generate':>10s} {'s':>6s}")
    for name, r in runs.items():
        same = r["tokens"] == reference
        print(f"{name:34s} {r['positions']:9d} {r['full']:17d} {r['sliding']:14d} {r['bytes']:14d} "
              f"{r['bytes'] / 2**20:8.2f} {r['pool_bytes'] / 2**20:19.2f} {str(same):>10s} {r['seconds']:6.1f}")
        if not same:
            raise SystemExit(f"{name}: the answer differs from generate's")
    with_pool, without = runs.values()
    print(f"held with the sliding layers' pool: {with_pool['bytes'] / without['bytes']:.3f} of the bytes "
          f"({without['bytes'] / with_pool['bytes']:.2f}x less)")


if __name__ == "__main__":
    main()
