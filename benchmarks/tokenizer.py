"""Tokenizer speed: hardway's encode against the tokenizers library (Rust), on the same files and the same text.

    uv run python benchmarks/tokenizer.py
    uv run python benchmarks/tokenizer.py --chars 200000 --word-chars 20000 --reps 3

Two tokenizers: GPT-2 (hardway's GPT2Tokenizer and tokenizers' BPE model, both from vocab.json + merges.txt) and
Llama 3 (BPETokenizer and tokenizers' Tokenizer, both from tokenizer.json). Four inputs each:

- Shakespeare, cold: both piece caches emptied before every run (hardway's dict, tokenizers' BPE cache);
- Shakespeare, warm: encoded again with every piece cached, the steady state on a lot of text;
- one word of random a-z letters, and one of random CJK characters (3 bytes each): a single piece with no break,
  where the merge algorithm alone decides the time (O(n log n) for both; the old loop was O(n²)).

The ids must be identical. Each time is a median of --reps runs, the two sides timed in turn in the same process;
the ratio is hardway / tokenizers (lower is better; pure Python against Rust). The machine's load moves absolute
times, so compare ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.text.bpe import BPETokenizer, GPT2Tokenizer  # noqa: E402
from hardway.formats.hub import checkpoint, shakespeare_path  # noqa: E402


def median_seconds(fn, reps: int, before=None) -> float:
    """Median wall time of fn() over `reps` runs; `before()` (untimed) runs before each one."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_word(first: int, last: int, n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randint(first, last)) for _ in range(n))


def tokenizer_pairs(gpt2: str, llama: str):
    """(name, ours, theirs, theirs' encode -> ids) for GPT-2 and Llama 3."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel

    folder = checkpoint(gpt2)
    theirs = Tokenizer(BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    theirs.pre_tokenizer = ByteLevel(add_prefix_space=False)
    yield "GPT-2", GPT2Tokenizer.from_files(folder / "vocab.json", folder / "merges.txt"), theirs
    path = checkpoint(llama) / "tokenizer.json"
    yield "Llama 3", BPETokenizer.from_tokenizer_json(path), Tokenizer.from_file(str(path))


def main(argv=None) -> dict[tuple[str, str], float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt2", default="openai-community/gpt2", help="hub id or folder with vocab.json, merges.txt")
    parser.add_argument("--llama", default="meta-llama/Llama-3.2-tokenizer", help="hub id or folder with tokenizer.json")
    parser.add_argument("--chars", type=int, default=100_000, help="characters of Shakespeare to encode")
    parser.add_argument("--word-chars", type=int, default=100_000, help="characters of each random word")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    book = shakespeare_path().read_text(encoding="utf-8")[: args.chars]
    inputs = {
        f"Shakespeare {len(book):,} chars, cold": book,
        f"Shakespeare {len(book):,} chars, warm": book,
        f"a-z word, {args.word_chars:,} chars": random_word(ord("a"), ord("z"), args.word_chars),
        f"CJK word, {args.word_chars:,} chars": random_word(0x4E00, 0x9FFF, args.word_chars),
    }
    print(f"medians of {args.reps}; ratio = hardway / tokenizers (time)")
    print(f"{'tokenizer':<8} {'input':<36} {'tokens':>8} {'tokenizers':>11} {'hardway':>11} {'ratio':>6}")
    ratios = {}
    for name, ours, theirs in tokenizer_pairs(args.gpt2, args.llama):
        for label, text in inputs.items():
            ids = ours.encode(text)
            if ids != theirs.encode(text).ids:
                raise SystemExit(f"FAIL: {name}, {label}: hardway and tokenizers give different ids")
            cold = label.endswith("cold")
            t_theirs = median_seconds(lambda: theirs.encode(text), args.reps,
                                      before=theirs.model._clear_cache if cold else None)
            t_ours = median_seconds(lambda: ours.encode(text), args.reps, before=ours.cache.clear if cold else None)
            ratios[(name, label)] = t_ours / t_theirs
            print(f"{name:<8} {label:<36} {len(ids):>8,} {t_theirs * 1e3:>8.1f} ms {t_ours * 1e3:>8.1f} ms "
                  f"{t_ours / t_theirs:>6.1f}")
    return ratios


if __name__ == "__main__":
    main()
