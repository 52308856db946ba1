"""Decode speed: transformers' greedy generate against hardway.generate, side by side, in one process.

    uv run python benchmarks/decode.py --model openai-community/gpt2
    uv run python benchmarks/decode.py --model HuggingFaceTB/SmolLM2-135M-Instruct --device cuda --dtype bfloat16

Both run on the same checkpoint folder, the same prompt, greedy, a fixed number of new tokens (EOS disabled on both
sides), with a full-length warm-up and several interleaved repetitions (CUDA events on a GPU); tokens must be identical, or
the run prints its speeds anyway and then exits with status 1. It prints tokens/s for
both (medians), the ratio, and the fraction of the bandwidth roofline: batch-1 decoding reads every weight once per
token, so tok/s ≤ memory bandwidth ÷ weight bytes, with the bandwidth measured in this run by a large copy.
The last line is the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.fast_decode import StaticDecodeStep, measure_bandwidth, roofline_tokens_per_s  # noqa: E402
from hardway.generation import generate  # noqa: E402
from hardway.hub import checkpoint, shakespeare_path  # noqa: E402
from hardway.loading import DTYPE_NAMES, load  # noqa: E402  (DTYPE_NAMES: the names the CLI accepts)
from hardway.memory import weight_bytes  # noqa: E402
from hardway.timing import time_interleaved  # noqa: E402


def prompt_ids(folder: Path, n_tokens: int) -> torch.Tensor:
    """The first n tokens of the course's English text, tokenized by the checkpoint's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = shakespeare_path().read_text(encoding="utf-8")[:20_000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise SystemExit(f"the text gives only {ids.shape[1]} tokens, fewer than --prompt-tokens {n_tokens}")
    return ids


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="hub id or local folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2, the course's CPU)")
    parser.add_argument("--compile", action="store_true",
                        help="also time hardway's static-shape compiled decode step, replayed as one CUDA graph (CUDA)")
    args = parser.parse_args(argv)
    if args.compile and not args.device.startswith("cuda"):
        raise SystemExit("--compile is the CUDA-graphs path: use it with --device cuda")
    torch.set_num_threads(args.threads)
    dtype = DTYPE_NAMES[args.dtype]

    from transformers import AutoModelForCausalLM

    folder = checkpoint(args.model)
    ids = prompt_ids(folder, args.prompt_tokens).to(args.device)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
    ours = load(folder, device=args.device, dtype=dtype)
    n = args.new_tokens

    def run_theirs():
        with torch.inference_mode():
            return theirs.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run_ours():
        return generate(ours, ids, max_new_tokens=n, do_sample=False, eos_token_id=None)

    fns = {"theirs": run_theirs, "ours": run_ours}
    if args.compile:  # the static-shape one-token step, one CUDA graph; its warm-up compiles and records it
        step = StaticDecodeStep(ours, max_len=ids.shape[1] + n)
        fns["compiled"] = lambda: step.generate(ids, n, do_sample=False, eos_token_id=None)
    times, outs = time_interleaved(fns, args.device, args.reps)
    t_theirs, t_ours, t_compiled = times["theirs"], times["ours"], times.get("compiled")
    same = outs["theirs"].shape == outs["ours"].shape and torch.equal(outs["theirs"].cpu(), outs["ours"].cpu())
    if args.compile:
        same_compiled = torch.equal(outs["compiled"].cpu(), outs["ours"].cpu())

    bandwidth = measure_bandwidth(args.device)
    wbytes = weight_bytes(ours)
    tps_theirs = n / statistics.median(t_theirs)
    tps_ours = n / statistics.median(t_ours)
    roofline = roofline_tokens_per_s(wbytes, bandwidth)
    loadavg = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"model {args.model}  device {args.device}  dtype {args.dtype}  threads {torch.get_num_threads()}  "
          f"load average {loadavg}")
    print(f"prompt {args.prompt_tokens} tokens, {n} new tokens, {args.reps} interleaved timed runs after a warm-up; "
          f"tokens {'identical' if same else 'DIFFERENT'}")
    print(f"weights {wbytes / 1e6:.1f} MB; measured copy bandwidth {bandwidth / 1e9:.1f} GB/s; roofline {roofline:.1f} tok/s")
    print(f"transformers generate: {tps_theirs:8.1f} tok/s  ({tps_theirs / roofline:.0%} of roofline)")
    print(f"hardway generate:      {tps_ours:8.1f} tok/s  ({tps_ours / roofline:.0%} of roofline)")
    ratio = tps_ours / tps_theirs
    if t_compiled is not None:
        tps_compiled = n / statistics.median(t_compiled)
        print(f"hardway compiled:      {tps_compiled:8.1f} tok/s  ({tps_compiled / roofline:.0%} of roofline); "
              f"tokens identical to eager: {same_compiled}")
        print(f"ratio hardway eager / transformers: {ratio:.2f}")
        ratio = tps_compiled / tps_theirs
        print(f"ratio hardway compiled / transformers: {ratio:.2f}")
    else:
        print(f"ratio hardway / transformers: {ratio:.2f}")
    if not same:  # the speeds are printed, but a fast wrong answer is a failure
        raise SystemExit("FAIL: hardway.generate and transformers' generate produced different tokens")
    return ratio


if __name__ == "__main__":
    main()
