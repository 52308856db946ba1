"""The sliding layers' pool, measured: KV bytes a sequence holds at 4,096 positions with and without it.

    uv run python benchmarks/sliding_kv.py                 # Gemma 3 270M's KV shapes, one sequence to 4,096 positions
    uv run python benchmarks/sliding_kv.py --positions 8192

A random Gemma 3 (lesson 20) with Gemma 3 270M's attention shapes (18 layers, 1 KV head of 256, 4 query heads, five
layers of every six attending to a window of 512 positions, the sixth to all; fp32) and small everything else (the
KV cache does not depend on the rest). One greedy request whose prompt and answer reach --positions positions runs through
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

from hardway.decode.generate import generate
from hardway.engine.engine import Engine
from hardway.engine.sequence import SamplingParams
from hardway.loading import load

N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, WINDOW, VOCAB = 18, 4, 1, 256, 512, 256


def gemma3_270m_shaped(max_positions: int):
    """A seeded random Gemma 3 (lesson 20) with Gemma 3 270M's attention shapes and its 5:1 pattern of sliding and
    full layers; small embeddings and MLP (the KV cache does not depend on them)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=N_LAYERS,
                              num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, head_dim=HEAD_DIM,
                              sliding_window=WINDOW, max_position_embeddings=max_positions, bos_token_id=1,
                              eos_token_id=2, layer_types=["full_attention" if (i + 1) % 6 == 0 else
                                                           "sliding_attention" for i in range(N_LAYERS)])
    reference = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # the default init leaves the norms' weights at 0: make every tensor matter
        for name, p in reference.named_parameters():
            p.copy_(0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        model = load(folder)
    assert model.sliding_windows.count(WINDOW) == 15 and model.sliding_windows.count(None) == 3
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
