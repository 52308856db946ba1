"""A GGUF run as it is stored (lesson 26's load_gguf_blocks) against the same file dequantized to fp32 (lesson 16's
hardway.load) and against llama.cpp on the same file, side by side in one run: one stream, greedy, tokens per second,
bytes read per token, the model's resident memory; optionally (--kl) top-1 agreement and KL divergence of the
next-token distributions against transformers' reading of the file.

    uv run python benchmarks/gguf_blocks.py
    uv run python benchmarks/gguf_blocks.py --llama-bench PEER_BUILD/bin/llama-bench --kl
    uv run python benchmarks/gguf_blocks.py --model FILE.gguf --blocks-only --kernels avx512_vnni,avx2 \
        --llama-bench avx512=PEER/build-native/bin/llama-bench --llama-bench avx2=PEER/build-avx2/bin/llama-bench

--kernels times the blocks path once per kernel of lesson 26 that the CPU runs (the AVX2 path on an AVX-512 CPU is
what a laptop without AVX-512 runs), in the same rounds: the compiled step calls the kernel chosen at each call, so one
compiled step serves them all. --llama-bench may be given several times, LABEL=PATH, for builds of llama.cpp with
different instruction sets.

Both hardway rows decode with lesson 12's compiled static-shape step (--eager: lesson 08's eager loop too), the same
prompt ids, a warm-up, then interleaved repetitions (medians); llama.cpp's row is its own `llama-bench -p 0 -n N
-t THREADS` (text generation after an empty prompt), run between the same repetitions. The read bandwidth (a 1 GiB
sum) is sampled in the same rounds. Memory, in a fresh process per path: what the model holds once loaded and decoding
(what dropping it gives back: the file's pages it maps, and what it allocated), and the process's whole growth over
the load and decode, which adds torch's own one-time machinery (torch itself is about half a gigabyte before it).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode import prompt_ids  # noqa: E402
from hardway.decode.generate import generate  # noqa: E402
from hardway.decode.static import StaticDecodeStep  # noqa: E402
from hardway.formats.gguf import gemma3_gguf, read_gguf  # noqa: E402
from hardway.formats.hub import models_dir  # noqa: E402
from hardway.kernels.gguf_blocks import gguf_kernel, use_kernel  # noqa: E402
from hardway.loading import load_gguf_blocks  # noqa: E402
from hardway.loading import load, open_model  # noqa: E402

LOADERS = {"fp32 (hardway.load)": load, "blocks (load_gguf_blocks)": load_gguf_blocks}


def resident_mb() -> float:
    """This process's resident set, in MB, after giving back what the allocator holds but nothing uses."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed memory; Linux only, as /proc is
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1e3


def memory_child(loader: str, path: str, n: int, compiled: bool) -> None:
    """In a fresh process: load with `loader`, decode n tokens, then drop the model. Prints as JSON the resident
    growth over the load and decode, and the part of it the model held: what dropping it gave back. The rest is
    torch's own, paid once per process (the first operations on the meta device, where the model is built, import
    torch's Python decompositions: about 150 MB here, whatever the model)."""
    before = resident_mb()
    model = LOADERS[loader](path)
    ids = torch.tensor([[2, 818, 5279]])  # (1, 3)
    if compiled:  # as `hardway generate` decodes: lesson 12's compiled step
        step = StaticDecodeStep(model, max_len=ids.shape[1] + n)
        step.generate(ids, n, eos_token_id=None)
    else:
        generate(model, ids, max_new_tokens=n, do_sample=False)
    loaded = resident_mb()
    del model
    if compiled:
        del step
    print(json.dumps({"resident_mb": loaded - before, "model_mb": loaded - resident_mb()}))


def resident_growth(loader: str, path: Path, n: int, compiled: bool) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--memory-child", loader, "--model", str(path), "--new-tokens",
                          str(n), *(["--memory-compiled"] if compiled else [])], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_bench(binary: str, path: Path, n: int, threads: int) -> float:
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
    out = subprocess.run([binary, "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(n), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True, env=env).stdout
    return float(json.loads(out[out.index("["):])[0]["avg_ts"])


@torch.inference_mode()
def agreement(model, reference_logp: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(transformers || model)) over the positions of ids."""
    logp = model(ids).log_softmax(-1)  # (1, T, V)
    kl = (reference_logp.exp() * (reference_logp - logp)).sum(-1)  # (1, T)
    return (logp.argmax(-1) == reference_logp.argmax(-1)).float().mean().item(), kl.mean().item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: Gemma 3 270M Q4_K_M from the models folder)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="also time lesson 08's eager loop on both")
    parser.add_argument("--llama-bench", metavar="[LABEL=]PATH", action="append", default=[],
                        help="llama.cpp's llama-bench, built outside the repository (several: LABEL=PATH each)")
    parser.add_argument("--kernels", default=None, help="the blocks path with each of these kernels (avx512_vnni, "
                        "avx2, neon, generic), comma-separated (default: the one chosen for the CPU)")
    parser.add_argument("--blocks-only", action="store_true", help="leave out the fp32 path")
    parser.add_argument("--memory-tokens", type=int, default=128,
                        help="tokens the memory measurement decodes with the compiled step (0: eager, 8 tokens)")
    parser.add_argument("--kl", action="store_true", help="top-1 and KL against transformers on --kl-tokens tokens")
    parser.add_argument("--kl-tokens", type=int, default=512)
    parser.add_argument("--memory-child", metavar="LOADER", help=argparse.SUPPRESS)
    parser.add_argument("--memory-compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.model or gemma3_gguf(models_dir() / "gguf")
    if args.memory_child:
        memory_child(args.memory_child, str(path), args.new_tokens, args.memory_compiled)
        return {}
    kernels = args.kernels.split(",") if args.kernels else [gguf_kernel()]
    for kernel in kernels:
        use_kernel(kernel)  # built now, and refused now if the CPU cannot run it
    benches = dict(spec.split("=", 1) if "=" in spec else ("", spec) for spec in args.llama_bench)
    loaders = {label: loader for label, loader in LOADERS.items() if not (args.blocks_only and label.startswith("fp32"))}
    source = open_model(path)
    ids = prompt_ids(source, args.prompt_tokens)  # (1, T)
    n = args.new_tokens
    models = {label: loader(path) for label, loader in loaders.items()}
    runs = {}  # label -> (kernel to use, or None; the run), or a llama-bench binary
    for label, model in models.items():
        step = StaticDecodeStep(model, max_len=ids.shape[1] + n)
        for kernel in kernels if label.startswith("blocks") else [None]:
            named = f"{label}, {kernel}" if kernel else label
            runs[f"{named}, compiled step"] = (kernel, lambda step=step: step.generate(ids, n, eos_token_id=None))
            if args.eager:
                runs[f"{named}, eager"] = (kernel, lambda model=model: generate(model, ids, max_new_tokens=n,
                                                                               eos_token_id=[]))
    for name, binary in benches.items():
        runs[f"llama.cpp {name} (llama-bench)".replace("  ", " ")] = binary

    def run_once(entry):
        kernel, run = entry
        if kernel is not None:
            use_kernel(kernel)
        return run()

    outputs = {label: run_once(run) for label, run in runs.items() if not isinstance(run, str)}  # warm-up: compiles
    read_buffer = torch.ones(2**30 // 4)  # 1 GiB: the read bandwidth in the same rounds
    rates, bandwidths = {label: [] for label in runs}, []
    for _ in range(args.reps):
        for label, run in runs.items():
            if isinstance(run, str):
                rates[label].append(llama_bench(run, path, n, args.threads))
                continue
            if run[0] is not None:
                use_kernel(run[0])
            start = time.perf_counter()
            run[1]()
            rates[label].append(n / (time.perf_counter() - start))
        start = time.perf_counter()
        read_buffer.sum()
        bandwidths.append(read_buffer.nbytes / (time.perf_counter() - start))
    file = read_gguf(path)
    stored = sum(info.n_bytes for info in file.tensors.values())
    fp32 = sum(4 * info.n_elements for info in file.tensors.values())
    read_per_token = {"fp32": fp32, "blocks": stored, "llama.cpp": stored}
    bandwidth = statistics.median(bandwidths)
    print(f"{path.name}: {path.stat().st_size / 1e6:.0f} MB; {args.threads} threads; {n} new tokens after "
          f"{ids.shape[1]}; kernels: {', '.join(kernels)}; read bandwidth (a 1 GiB sum, same rounds) "
          f"{bandwidth / 1e9:.1f} GB/s; load average {os.getloadavg()[0]:.1f}")
    llama = {name: statistics.median(rates[label]) for name, label in
             ((name, f"llama.cpp {name} (llama-bench)".replace("  ", " ")) for name in benches)}

    def peer(label: str) -> float | None:
        """The llama.cpp build to compare a row with: the one whose label names the row's kernel family
        (avx2 with avx2, avx512 with avx512_vnni), else the only one."""
        for name, rate in llama.items():
            if name and name.split("_")[0] in label:
                return rate
        return next(iter(llama.values())) if len(llama) == 1 else None

    table = {}
    print(f"{'':52} {'tok/s':>7} {'MB/token':>9} {'GB/s':>6} {'vs llama.cpp':>12}")
    for label in runs:
        rate, against = statistics.median(rates[label]), None if label.startswith("llama.cpp") else peer(label)
        mb = read_per_token[next(k for k in read_per_token if label.startswith(k))] / 1e6
        ratio = f"{rate / against:.2f}x" if against else "-"
        table[label] = {"tok_s": rate, "mb_per_token": mb, "vs_llama_cpp": rate / against if against else None}
        print(f"{label:52} {rate:7.1f} {mb:9.0f} {rate * mb / 1e3:6.1f} {ratio:>12}")
    compiled = [label for label in outputs if label.endswith("compiled step")]
    first = outputs[compiled[0]][0, ids.shape[1]:]
    for label in compiled[1:]:
        same = next((i for i, (a, b) in enumerate(zip(first, outputs[label][0, ids.shape[1]:])) if a != b), n)
        print(f"greedy tokens: {label}'s first {same} of {n} equal {compiled[0]}'s")
    size = path.stat().st_size / 1e6
    for label in loaders:
        memory = resident_growth(label, path, args.memory_tokens or 8, compiled=args.memory_tokens > 0)
        table[label.split(" ")[0] + " resident"] = memory
        print(f"resident memory, {label}: the model holds {memory['model_mb']:.0f} MB "
              f"({memory['model_mb'] / size:.2f}x the file); the process grew {memory['resident_mb']:.0f} MB "
              f"({memory['resident_mb'] / size:.2f}x)")
    if args.kl:
        from hardway.verify.ritual import load_reference

        corpus = prompt_ids(source, args.kl_tokens)
        with torch.inference_mode():
            reference = load_reference(path)(corpus).logits.log_softmax(-1)  # (1, T, V)
        for label, model in models.items():
            top1, kl = agreement(model, reference, corpus)
            table[label + " vs transformers"] = {"top1": top1, "kl": kl}
            print(f"{label} against transformers, {args.kl_tokens} tokens: top-1 {100 * top1:.1f}%, KL {kl:.2e}")
    return table


if __name__ == "__main__":
    main()
