"""Latent attention's two decode forms side by side (lesson 29): the naive one, which expands every cached latent to
per-head keys and values through kv_b_proj at each step, and the absorbed one, which folds W_UK into the query and
W_UV into the output and attends over the latents themselves.

One DeepSeek-V3 model with random weights (by default DeepSeek-V2-Lite's attention: hidden 2048, 16 heads,
kv_lora_rank 512, no query compression, qk_nope 128, qk_rope 64, v 128; dense MLPs, 4 layers, a small vocabulary),
its LatentCache filled with random latents up to each context length (decoding costs the same whatever they hold).
For each length and form: the bytes the attention moves per step (computed: latents read; in the naive form the
expanded keys and values written and read back; kv_b_proj's weight), and the decode tokens/s measured, both forms
in alternating rounds of the same run, medians.

    uv run python benchmarks/mla.py                       # the table in docs/performance.md
    uv run python benchmarks/mla.py --lengths 256 1024    # fewer lengths
    uv run python benchmarks/mla.py --threads 1           # one thread (a machine shared with other work)

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.models.deepseek_v3 import DeepseekV3, deepseek_v3_config  # noqa: E402

FORMS = ("naive", "absorbed")


def build(hidden: int, heads: int, layers: int, vocab: int, max_len: int) -> DeepseekV3:
    config = deepseek_v3_config(dict(
        model_type="deepseek_v3", vocab_size=vocab, hidden_size=hidden, intermediate_size=1408,
        num_hidden_layers=layers, num_attention_heads=heads, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=layers, n_routed_experts=8,
        n_group=1, topk_group=1, num_experts_per_tok=2, max_position_embeddings=max_len))
    model = DeepseekV3(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)  # matrices random, norms' weights 1
    return model.eval()


def attention_bytes(config, S: int, form: str) -> int:
    """Bytes one decode step's attention moves over all layers at S cached positions (fp32): the latents read (the
    absorbed form reads them twice: as keys, then the first r numbers as values), the naive form's expanded keys and
    values written then read, and kv_b_proj's weight."""
    H, r, dr = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    dn, dv = config.qk_nope_head_dim, config.v_head_dim
    weight = r * H * (dn + dv)
    if form == "naive":
        per_layer = S * (r + dr) + 2 * S * H * (dn + dr + dv) + weight
    else:
        per_layer = S * (r + dr) + S * r + weight
    return 4 * config.num_hidden_layers * per_layer


@torch.inference_mode()
def step_seconds(model, cache, S: int, steps: int) -> float:
    """Median seconds of one decode step at position S (the same slot rewritten each step: the context stays S)."""
    token = torch.tensor([[7]])  # (1, 1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(token, kv_cache=cache, start_pos=S, last_only=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096], help="context lengths")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    parser.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary (default 4096)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per form; medians (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args.hidden, args.heads, args.layers, args.vocab, max(args.lengths) + 1)
    config = model.config
    print(f"DeepSeek-V3 attention, {config.num_hidden_layers} layers, {config.num_attention_heads} heads, "
          f"kv_lora_rank {config.kv_lora_rank}, rope {config.qk_rope_head_dim}, fp32, "
          f"{torch.get_num_threads()} threads\n")
    print("| context | form | attention MB moved per step | decode tok/s (median) |")
    print("|---:|---|---:|---:|")
    for S in args.lengths:
        cache = model.new_kv_cache(1, S + 1)
        cache.k.normal_()  # latents of S positions: any values cost the same
        for form in FORMS:  # warm up each
            model.decode_form = form
            step_seconds(model, cache, S, 2)
        seconds = {form: [] for form in FORMS}
        for _ in range(args.rounds):  # alternating: both forms see the same machine
            for form in FORMS:
                model.decode_form = form
                seconds[form].append(step_seconds(model, cache, S, args.steps))
        for form in FORMS:
            mb = attention_bytes(config, S, form) / 1e6
            print(f"| {S} | {form} | {mb:.1f} | {1 / statistics.median(seconds[form]):.1f} |", flush=True)


if __name__ == "__main__":
    main()
