"""Decode throughput against batch size: hardway.generate and transformers' generate with B rows, side by side (lesson 13).

    uv run python benchmarks/batch.py --model HuggingFaceTB/SmolLM2-135M-Instruct
    uv run python benchmarks/batch.py --model openai-community/gpt2 --batch-sizes 1 4 16 --new-tokens 64

For each batch size, the time of one decode step is measured as (time of N new tokens - time of 1) / (N - 1), so the
prefill cancels, median of several repetitions after a warm-up (hardway.instruments.timing.decode_step_seconds). Every step
makes one token per row: aggregate throughput = B / step time, and the per-token latency each row sees is the step
time. The roofline bound for a step is max(weight bytes / bandwidth, 2 x parameters x B / peak FLOP/s), with the
bandwidth measured by a large copy (lesson 12) and the peak by a large matmul, both in this run. transformers' generate
on the same folder is timed the same way (greedy, exactly N new tokens), batch size by batch size, in the same run.
It prints a table in Markdown, ready for the README.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.instruments.timing import decode_step_seconds, matmul_flops  # noqa: E402
from hardway.instruments.roofline import measure_bandwidth  # noqa: E402
from hardway.formats.hub import checkpoint  # noqa: E402
from hardway.instruments.memory import weight_bytes as count_weight_bytes  # noqa: E402
from hardway.loading import DTYPE_NAMES, load  # noqa: E402  (DTYPE_NAMES: the names the CLI accepts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.reps < 1 or min(args.batch_sizes) < 1:
        parser.error("--new-tokens must be >= 2, --reps and every batch size >= 1")

    from transformers import AutoModelForCausalLM  # the reference, timed side by side

    dtype = DTYPE_NAMES[args.dtype]
    folder = checkpoint(args.model)
    model = load(folder, device=args.device, dtype=dtype)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()

    def theirs_n(ids, n):  # exactly n new tokens, greedy, no padding
        return theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)

    n_params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once
    weight_bytes = count_weight_bytes(model)  # a tied embedding once
    bandwidth = measure_bandwidth(args.device)
    flops = matmul_flops(args.device, dtype)
    print(f"{args.model} on {args.device} in {args.dtype}: {n_params / 1e6:.0f}M parameters, {weight_bytes / 1e6:.0f} MB; "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s, "
          f"ridge point B* ≈ {flops * weight_bytes / (2 * n_params * bandwidth):.0f}; torch threads "
          f"{torch.get_num_threads()}; prompt {args.prompt_len} tokens, {args.new_tokens} new, median of {args.reps}")
    print()
    print("| batch | ms per step (per-token latency) | tokens/s, all rows | × batch 1 | transformers tokens/s | "
          "hardway / transformers | roofline bound, tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for b in args.batch_sizes:
        step = decode_step_seconds(model, b, args.prompt_len, args.new_tokens, args.reps)
        their_step = decode_step_seconds(theirs, b, args.prompt_len, args.new_tokens, args.reps, generate_n=theirs_n)
        rate = b / step
        base = base or rate
        bound = min(b * bandwidth / weight_bytes, flops / (2 * n_params))
        print(f"| {b} | {1e3 * step:.1f} | {rate:.1f} | {rate / base:.2f} | {b / their_step:.1f} | "
              f"{their_step / step:.2f} | {bound:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
