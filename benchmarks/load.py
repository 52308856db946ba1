"""Safetensors load time: hardway.formats.safetensors.load_file against the safetensors library, on the same file.

    uv run python benchmarks/load.py --model openai-community/gpt2
    uv run python benchmarks/load.py --model HuggingFaceTB/SmolLM2-135M-Instruct --touch

Both sides memory-map the file and return CPU tensors; both results must be equal, tensor by tensor. By default a load
is timed as such (mapping + building the tensors); `--touch` also reads every byte (sums each tensor), so lazy mapping
cannot hide the I/O. Warm-up, several repetitions, medians; the file is in the page cache after the warm-up. The last
line is the ratio hardway / safetensors (time: lower is better).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.formats.hub import checkpoint  # noqa: E402
from hardway.formats.safetensors import load_file  # noqa: E402


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up: page cache, imports
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="openai-community/gpt2", help="hub id, folder, or a .safetensors file")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--touch", action="store_true", help="also read every byte of every tensor")
    args = parser.parse_args(argv)
    from safetensors.torch import load_file as st_load_file

    path = Path(args.model)
    if path.suffix != ".safetensors":
        folder = checkpoint(args.model)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SystemExit(f"{folder} has no .safetensors file")
        path = files[0]

    ours, theirs = load_file(path), st_load_file(str(path))
    if ours.keys() != theirs.keys() or not all(torch.equal(ours[k], theirs[k]) for k in ours):
        raise SystemExit("FAIL: hardway.formats.safetensors.load_file and safetensors.torch.load_file differ")

    def timed(loader):
        def run():
            tensors = loader(path)
            if args.touch:
                for t in tensors.values():
                    t.float().sum() if t.dtype != torch.float32 else t.sum()
            return tensors
        return run

    t_ours = median_seconds(timed(load_file), args.reps)
    t_theirs = median_seconds(timed(lambda p: st_load_file(str(p))), args.reps)
    size = path.stat().st_size
    print(f"file {path.name} ({size / 1e6:.1f} MB, {len(ours)} tensors); {args.reps} timed runs after a warm-up"
          f"{', every byte read' if args.touch else ''}")
    print(f"safetensors load_file: {t_theirs * 1e3:8.2f} ms")
    print(f"hardway load_file:     {t_ours * 1e3:8.2f} ms")
    ratio = t_ours / t_theirs
    print(f"ratio hardway / safetensors (time): {ratio:.2f}")
    return ratio


if __name__ == "__main__":
    main()
