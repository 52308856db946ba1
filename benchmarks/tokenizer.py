"""Tokenizer speed: hardway's GPT2Tokenizer.encode against the tokenizers library (Rust), on the same text.

    uv run python benchmarks/tokenizer.py                      # GPT-2's vocab.json + merges.txt, Shakespeare
    uv run python benchmarks/tokenizer.py --chars 200000

Both tokenizers are built from the same vocab.json and merges.txt; the ids must be identical. Each side is timed
with a fresh tokenizer (cold: our piece cache empty) and again on the warm one. Medians of several repetitions.
The last line is the ratio of the cold times, hardway / tokenizers (lower is better; pure Python against Rust).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.bpe import GPT2Tokenizer  # noqa: E402
from hardway.hub import checkpoint, models_dir  # noqa: E402


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="openai-community/gpt2", help="hub id or folder with vocab.json, merges.txt")
    parser.add_argument("--chars", type=int, default=100_000, help="characters of Shakespeare to encode")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder

    folder = checkpoint(args.model)
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    text = (models_dir() / "data" / "shakespeare.txt").read_text(encoding="utf-8")[: args.chars]

    def theirs_new():
        tok = Tokenizer(BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
        tok.decoder = ByteLevelDecoder()
        return tok

    def ours_new():
        return GPT2Tokenizer.from_files(vocab, merges)

    ours, theirs = ours_new(), theirs_new()
    ids = ours.encode(text)
    if ids != theirs.encode(text).ids:
        raise SystemExit("FAIL: hardway and tokenizers give different ids")

    cold_ours = median_seconds(lambda: ours_new().encode(text), args.reps) - median_seconds(ours_new, args.reps)
    cold_theirs = median_seconds(lambda: theirs_new().encode(text).ids, args.reps) - median_seconds(theirs_new, args.reps)
    warm_ours = median_seconds(lambda: ours.encode(text), args.reps)
    warm_theirs = median_seconds(lambda: theirs.encode(text).ids, args.reps)
    print(f"{args.chars:,} characters of Shakespeare -> {len(ids):,} tokens, identical ids; medians of {args.reps}")
    for name, cold, warm in (("tokenizers (Rust)", cold_theirs, warm_theirs), ("hardway GPT2Tokenizer", cold_ours, warm_ours)):
        print(f"{name:<22} cold {cold * 1e3:8.1f} ms ({len(ids) / cold / 1e3:7.0f}k tok/s)   "
              f"warm {warm * 1e3:8.1f} ms ({len(ids) / warm / 1e3:7.0f}k tok/s)")
    ratio = cold_ours / cold_theirs
    print(f"ratio hardway / tokenizers (cold encode time): {ratio:.1f}")
    return ratio


if __name__ == "__main__":
    main()
