"""Decode speed: hardway against transformers' greedy generate (and llama.cpp, optionally), side by side, in one process.

    uv run python benchmarks/decode.py --model openai-community/gpt2
    uv run python benchmarks/decode.py --model HuggingFaceTB/SmolLM2-135M-Instruct --compile --gemv \\
        --llama-cpp smollm2-135m-f32.gguf --llama-cpp-path PEER_VENV/lib/python3.11/site-packages
    uv run python benchmarks/decode.py --model HuggingFaceTB/SmolLM2-135M-Instruct --device cuda --dtype bfloat16 --compile
    uv run python benchmarks/decode.py --model standins/gguf/gemma-3-270m-q4_k_m.gguf --compile \
        --llama-cpp standins/gguf/gemma-3-270m-q4_k_m.gguf --llama-cpp-path PEER_VENV/lib/python3.11/site-packages

Every engine runs on the same checkpoint (llama.cpp on an F32 GGUF converted from the same folder, docs/performance.md
says how; or, for a `.gguf` model, on that very file, which hardway and transformers dequantize at load), the same
prompt ids, greedy, a fixed number of new tokens (EOS disabled everywhere), with a full-length warm-up and several
interleaved repetitions (CUDA events on a GPU); hardway's tokens must be identical to transformers', or the run prints
its speeds anyway and then exits with status 1 (llama.cpp's are reported: on a quantized file it computes on the
quantized blocks). It prints tokens/s (medians), each engine's share of the roofline and the
ratios. Batch-1 decoding reads every weight once per token, so tok/s <= read bandwidth / weight bytes; the read
bandwidth is measured by a large sum (what decoding does) in the same interleaved rounds as the engines, so that it
sees the same background load, next to the copy figure (reads and writes, measured after).

`--compile`: hardway's static-shape compiled decode step (lesson 12): on CPU inductor with the matrix-vector products as
streaming sums, on CUDA replayed as one CUDA graph; its first call, the compilation, is timed; and `hardway.generate`
with no flags on a model as `hardway.load` lays it out by default (what a user runs: compiled where it pays). `--gemv`: the GB/s of
each matrix-vector kernel on the model's own matrix shapes. `--llama-cpp GGUF`: llama.cpp on that file, when the
`llama_cpp` module is importable (`--llama-cpp-path` adds a folder, e.g. a separate venv's site-packages, at the end
of the import path). `--one-thread`: also the compiled step (compiled again, on one thread) and llama.cpp on one
thread, with a one-thread read bandwidth for their roofline, in the same rounds. The last line is the ratio
hardway / transformers (compiled when --compile).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hardway
from hardway.decode.static import StaticDecodeStep
from hardway.kernels.compile import cpu_decode_backend, matvec_as_sum
from hardway.kernels.layout import lay_out_for_decode
from hardway.instruments.roofline import measure_bandwidth, roofline_tokens_per_s
from hardway.decode.generate import decode_one_token, generate, prefill  # noqa: E402
from hardway.formats.hub import shakespeare_path  # noqa: E402
from hardway.loading import DTYPE_NAMES, ModelSource, load, open_model  # noqa: E402  (DTYPE_NAMES: the CLI's names)
from hardway.instruments.memory import weight_bytes  # noqa: E402
from hardway.instruments.timing import time_interleaved  # noqa: E402


def prompt_ids(source: ModelSource, n_tokens: int) -> torch.Tensor:
    """The first n tokens of the course's English text, tokenized by transformers' tokenizer of the same model."""
    from transformers import AutoTokenizer

    folder, gguf = source.from_pretrained_args()
    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    text = shakespeare_path().read_text(encoding="utf-8")[:20_000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise SystemExit(f"the text gives only {ids.shape[1]} tokens, fewer than --prompt-tokens {n_tokens}")
    return ids


def llama_cpp_generate(gguf: str, path: str | None, n_threads: int):
    """A function ids (1, T) -> (1, T + n) running llama.cpp's greedy decoding (temp 0, top-k 1, no repeat penalty)."""
    if path:
        sys.path.append(path)  # at the end: this environment's numpy and torch stay first
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"--llama-cpp needs the llama_cpp module ({e}); the README says how to build it") from e
    llm = llama_cpp.Llama(gguf, n_threads=n_threads, n_threads_batch=n_threads, n_ctx=512, verbose=False)

    def run(ids: torch.Tensor, n: int) -> torch.Tensor:
        llm.reset()  # no prefix reuse between runs: every run prefills the whole prompt, as the others do
        prompt, out = ids[0].tolist(), []
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == n:
                break
        return torch.tensor([prompt + out])
    return run


def operators_per_step(model, ids: torch.Tensor) -> int:
    """The operators Python calls in one eager one-token step (aten ops not called by another aten op), profiled."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        cache = model.new_kv_cache(1, ids.shape[1] + 1)
        prefill(model, ids, cache)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode_one_token(model, ids[:, -1:], torch.tensor(ids.shape[1]), cache)
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))


def gemv_table(model, bandwidth: float, threads: int, reps: int = 5) -> None:
    """GB/s of each one-token matrix-vector kernel on the model's distinct matrix shapes (fp32, CPU), vs the read
    bandwidth: torch's F.linear on both layouts, and lesson 12's matvec_as_sum compiled by inductor."""
    shapes = sorted({tuple(p.shape) for p in model.parameters() if p.dim() == 2}, key=lambda s: s[0] * s[1])
    compiled = torch.compile(lambda x, w: matvec_as_sum(x, w.T), backend=cpu_decode_backend, dynamic=False)
    print(f"matrix-vector kernels, fp32, {threads} threads, GB/s of weights read (read bandwidth {bandwidth / 1e9:.1f}):")
    with torch.inference_mode():
        for shape in shapes:
            copies = max(1, 64 * 2**20 // (4 * shape[0] * shape[1]))  # >= 64 MiB in all: beyond the caches
            ws = [torch.randn(shape) for _ in range(copies)]  # (out, in) each, row by row
            cols = [w.T.contiguous().T for w in ws]  # the same, column by column (decode_layout's wide matrices)
            x = torch.randn(1, shape[1])  # (1, in)
            fns = {"F.linear rows": lambda: [F.linear(x, w) for w in ws],
                   "F.linear columns": lambda: [F.linear(x, w) for w in cols],
                   "matvec_as_sum rows": lambda: [compiled(x, w) for w in ws]}
            times, _ = time_interleaved(fns, "cpu", reps)
            gbs = {k: copies * ws[0].nbytes / statistics.median(t) / 1e9 for k, t in times.items()}
            print(f"  {shape[0]:>6} x {shape[1]:<5}" + "".join(f"  {k} {v:5.1f} ({v * 1e9 / bandwidth:4.0%})"
                                                           for k, v in gbs.items()))


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="hub id, local folder or .gguf file")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads, every engine (default 2)")
    parser.add_argument("--compile", action="store_true", help="also time hardway's compiled static-shape decode step")
    parser.add_argument("--gemv", action="store_true", help="print each matrix-vector kernel's GB/s (CPU fp32)")
    parser.add_argument("--llama-cpp", metavar="GGUF", help="also time llama.cpp on this GGUF of the same weights")
    parser.add_argument("--llama-cpp-path", metavar="DIR", help="a folder holding the llama_cpp module")
    parser.add_argument("--one-thread", action="store_true",
                        help="also time the compiled step (with --compile) and llama.cpp on 1 thread, same rounds")
    args = parser.parse_args(argv)
    if args.llama_cpp and args.device != "cpu":
        raise SystemExit("--llama-cpp compares on the CPU: use it with --device cpu")
    torch.set_num_threads(args.threads)
    dtype = DTYPE_NAMES[args.dtype]

    from transformers import AutoModelForCausalLM

    folder = open_model(args.model)  # a .gguf: transformers dequantizes the same file (gguf_file=), hardway too
    ids = prompt_ids(folder, args.prompt_tokens).to(args.device)
    reference_folder, gguf = folder.from_pretrained_args()
    theirs = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=dtype, **gguf).to(args.device).eval()
    ours = lay_out_for_decode(load(folder, device=args.device, dtype=dtype), compiled=False)  # eager: its layout
    n = args.new_tokens

    def run_theirs():
        with torch.inference_mode():
            return theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)

    fns = {"transformers": run_theirs,
           "hardway": lambda: generate(ours, ids, max_new_tokens=n, eos_token_id=None)}
    compile_s = None
    if args.compile:  # its own copy: on CPU the compiled step re-stores the matrices row by row
        step = StaticDecodeStep(load(folder, device=args.device, dtype=dtype), max_len=ids.shape[1] + n)
        started = time.perf_counter()
        step.generate(ids, n, eos_token_id=None)  # the first call compiles
        compile_s = time.perf_counter() - started
        fns["hardway compiled"] = lambda: step.generate(ids, n, eos_token_id=None)
        # hardway.generate with no flags, on a model as hardway.load lays it out by default: what a user runs
        default_model = load(folder, device=args.device, dtype=dtype)
        started = time.perf_counter()
        hardway.generate(default_model, ids, max_new_tokens=n, eos_token_id=None)  # compiles where it pays
        default_first_s = time.perf_counter() - started
        fns["hardway.generate (defaults)"] = lambda: hardway.generate(default_model, ids, max_new_tokens=n,
                                                                      eos_token_id=None)
    if args.llama_cpp:
        llama_run = llama_cpp_generate(args.llama_cpp, args.llama_cpp_path, args.threads)
        fns["llama.cpp"] = lambda: llama_run(ids.cpu(), n)
    read_buffer = torch.ones(2**30 // 4, dtype=torch.float32, device=args.device)  # 1 GiB of fp32
    reads = {"read": read_buffer.sum}
    compile_1_s = None
    if args.one_thread and args.device == "cpu":
        def on_one_thread(fn):
            def run():
                torch.set_num_threads(1)
                try:
                    return fn()
                finally:
                    torch.set_num_threads(args.threads)
            return run

        reads["read, 1 thread"] = on_one_thread(read_buffer.sum)
        if args.compile:  # compiled on one thread: inductor's C++ loops take the thread count they are compiled with
            step_1 = StaticDecodeStep(load(folder, device=args.device, dtype=dtype), max_len=ids.shape[1] + n)
            started = time.perf_counter()
            on_one_thread(lambda: step_1.generate(ids, n, eos_token_id=None))()
            compile_1_s = time.perf_counter() - started
            fns["hardway compiled, 1 thread"] = on_one_thread(lambda: step_1.generate(ids, n, eos_token_id=None))
        if args.llama_cpp:
            llama_run_1 = llama_cpp_generate(args.llama_cpp, args.llama_cpp_path, 1)
            fns["llama.cpp, 1 thread"] = lambda: llama_run_1(ids.cpu(), n)
    # The roofline's bandwidth is sampled in the same rounds as the engines (a 1 GiB sum between their runs), so a
    # burst of background load lowers it as it lowers them: on a shared machine a figure measured once, before or
    # after, can be from another load.
    times, outs = time_interleaved({**fns, **reads}, args.device, args.reps)
    read_bws = {name: read_buffer.nbytes / statistics.median(times.pop(name)) for name in reads}
    read_bw = read_bws["read"]
    for name in reads:
        del outs[name]
    del read_buffer
    tps = {name: n / statistics.median(t) for name, t in times.items()}
    same = {name: out.shape == outs["transformers"].shape and torch.equal(out.cpu(), outs["transformers"].cpu())
            for name, out in outs.items()}

    copy_bw = measure_bandwidth(args.device)
    wbytes = weight_bytes(ours)
    roofline = roofline_tokens_per_s(wbytes, read_bw)
    loadavg = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"model {args.model}  device {args.device}  dtype {args.dtype}  threads {torch.get_num_threads()}  "
          f"load average {loadavg}")
    print(f"prompt {args.prompt_tokens} tokens, {n} new tokens, {args.reps} interleaved timed runs after a warm-up")
    print(f"weights {wbytes / 1e6:.1f} MB; read bandwidth (a 1 GiB sum, in the same rounds) {read_bw / 1e9:.1f} GB/s, "
          f"copy (after) {copy_bw / 1e9:.1f} GB/s; roofline {roofline:.1f} tok/s")
    if "read, 1 thread" in read_bws:
        print(f"on 1 thread: read bandwidth {read_bws['read, 1 thread'] / 1e9:.1f} GB/s; roofline "
              f"{roofline_tokens_per_s(wbytes, read_bws['read, 1 thread']):.1f} tok/s")
    for name, s in tps.items():
        bw = read_bws["read, 1 thread"] if name.endswith("1 thread") else read_bw
        print(f"{name + ':':<28} {s:8.1f} tok/s  ({s / roofline_tokens_per_s(wbytes, bw):4.0%} of roofline)  "
              f"tokens {'identical to transformers' if same[name] else 'DIFFERENT from transformers'}")
    print(f"operators per eager one-token step: {operators_per_step(ours, ids)}")
    if compile_s is not None:
        print(f"compiled step: first call {compile_s:.1f} s (compilation + one generation of "
              f"{n / tps['hardway compiled']:.1f} s)")
        print(f"hardway.generate (defaults): first call {default_first_s:.1f} s (compiles on first use, or reads the "
              f"compile cache)")
    if compile_1_s is not None:
        print(f"compiled step, 1 thread: first call {compile_1_s:.1f} s")
    if args.gemv and args.device == "cpu" and dtype == torch.float32:
        gemv_table(ours, read_bw, args.threads)
    best = "hardway compiled" if args.compile else "hardway"
    if args.llama_cpp:
        print(f"ratio {best} / llama.cpp: {tps[best] / tps['llama.cpp']:.2f}")
        if args.compile:
            print(f"ratio hardway.generate (defaults) / llama.cpp: "
                  f"{tps['hardway.generate (defaults)'] / tps['llama.cpp']:.2f}")
    if "hardway compiled, 1 thread" in tps and "llama.cpp, 1 thread" in tps:
        print(f"ratio hardway compiled / llama.cpp, 1 thread: "
              f"{tps['hardway compiled, 1 thread'] / tps['llama.cpp, 1 thread']:.2f}")
    if args.compile:
        print(f"ratio hardway compiled / eager: {tps['hardway compiled'] / tps['hardway']:.2f}")
    ratio = tps[best] / tps["transformers"]
    print(f"ratio {best} / transformers: {ratio:.2f}")
    # The speeds are printed, but a fast wrong answer is a failure. llama.cpp is a peer timed on its own arithmetic
    # (on a quantized file it multiplies quantized blocks, so its tokens may differ): reported, not failed.
    wrong = [k for k, v in same.items() if not v and not k.startswith("llama.cpp")]
    if wrong:
        raise SystemExit(f"FAIL: different tokens from transformers': {wrong}")
    return ratio


if __name__ == "__main__":
    main()
