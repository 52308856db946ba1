"""Quantized decoding: weight bytes, decode tok/s and perplexity of SmolLM2 in fp32, int8, int4 and the GGUF's own
Q4_1 blocks, side by side in one process, with llama.cpp on the same GGUF (and on a Q8_0 it makes itself).

    uv run python benchmarks/quant.py
    uv run python benchmarks/quant.py --llama-cpp-path PEER_VENV/lib/python3.11/site-packages \\
        --llama-cpp-f32 smollm2-135m-f32.gguf

Every hardway format decodes with lesson 12's compiled static-shape step (inductor on CPU, the quantized layers'
one-row products fused into loops over the integers); the rows named "C loop" send those one-row products to
hardway.kernels.c_loops' C loops instead, on the fp32 row, inside the same compiled step (where a C compiler is found), with
the calls that share a row merged (group_c_loops: q, k, v one call, gate and up another).
`--c-loop-one-call-a-layer` adds the same loops without the merging, for comparison. `--c-loop-int8-rows` adds, on a
CPU with AVX512-VNNI, the integer loops, which round each input row to int8 in blocks of 32 first, so their perplexity
is scored with every quantized layer's input rounded the same way (the arithmetic of the loops, on the prompt
windows). `--eager` adds the
eager step with torch's own CPU weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) and fp32
eager. Batch 1, greedy, the same prompt ids, a fixed number of new tokens, a full-length warm-up, then interleaved
repetitions (medians); the read bandwidth (a 1 GiB sum) is sampled in the same rounds. Quantized formats may pick
other tokens than fp32: the table says how many of the first new tokens agree. Perplexity: lesson 11's windows (512,
stride 256) on the first --ppl-tokens tokens of the course's text, each format against fp32, llama.cpp's formats too
(its logits on the same windows). `--llama-cpp-f32 GGUF`: an F32 GGUF of the same weights, which llama.cpp's own
quantizer turns into a Q8_0 (and which it also times).
The table is also written to --table (default benchmarks/quant_results.json, committed: docs/quantization.md reports it), with the
machine, the date, the load average and the command line.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode import llama_cpp_generate, prompt_ids  # noqa: E402
from hardway.kernels.c_loops import c_loop_decode_backend, c_loops_available, c_loops_quantize_activations  # noqa: E402
from hardway.decode.static import StaticDecodeStep  # noqa: E402
from hardway.kernels.layout import lay_out_for_decode
from hardway.decode.generate import generate  # noqa: E402
from hardway.formats.gguf import smollm2_gguf  # noqa: E402
from hardway.formats.hub import checkpoint  # noqa: E402
from hardway.loading import forward_once, load  # noqa: E402
from hardway.kernels.quantized import QuantizedLinear, quantize_linears, round_activations, weights_nbytes  # noqa: E402
from hardway.loading import gguf_quantized  # noqa: E402
from hardway.instruments.timing import time_interleaved  # noqa: E402
from hardway.verify.ritual import eval_text, perplexity, window_nlls  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Every compiled row is another model through the same decode_one_token: a recompilation each, which dynamo caps at 8
# per function by default; with both C-loop flags there are 14.
torch._dynamo.config.recompile_limit = 32
TABLE = Path(__file__).resolve().parent / "quant_results.json"


def cpu_name() -> str:
    """The CPU's model name as Linux reports it, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cell(value, fmt: str) -> str:
    """A table cell: `value` formatted, or "-" where there is none."""
    return "-" if value is None else fmt.format(value)


def write_table(path: Path, table: dict) -> None:
    """`table` as JSON at `path`, written under a temporary name first: never half a file under the final name."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(partial, path)


def llama_cpp_q8_0(f32_gguf: str, out_dir: str, path: str | None) -> str:
    """A Q8_0 GGUF made by llama.cpp's own quantizer from an F32 one (written under a temporary name, then renamed)."""
    if path:
        sys.path.append(path)
    import llama_cpp

    out = Path(out_dir) / "smollm2-135m-q8_0.gguf"
    partial = out.with_suffix(".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(f32_gguf).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {f32_gguf} to Q8_0")
    os.replace(partial, out)
    return str(out)


def llama_cpp_logits(gguf: str, path: str | None, n_threads: int, n_ctx: int = 512):
    """A function ids (1, T) -> logits (1, T, vocab) from llama.cpp on `gguf` (every position's logits kept), for
    the same perplexity windows as ours. T at most n_ctx."""
    if path:
        sys.path.append(path)  # at the end: this environment's numpy and torch stay first
    import llama_cpp

    llm = llama_cpp.Llama(gguf, n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx, n_batch=n_ctx,
                          logits_all=True, verbose=False)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        llm.reset()  # a fresh cache: each window is scored on its own, as ours are
        llm.eval(ids[0].tolist())
        return torch.tensor(llm.scores[:ids.shape[1]]).unsqueeze(0)  # (1, T, vocab)
    return logits


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--untimed", nargs="*", default=["int4, groups of 64"],
                        help="formats scored for perplexity but not timed (each timed one costs a compilation)")
    parser.add_argument("--eager", action="store_true", help="also time fp32 eager and torch's weight-only kernels")
    parser.add_argument("--llama-cpp-path", metavar="DIR", help="a folder holding the llama_cpp module")
    parser.add_argument("--llama-cpp-f32", metavar="GGUF", help="an F32 GGUF of the same weights, for llama.cpp's Q8_0")
    parser.add_argument("--no-c-loop", action="store_true", help="leave out the C loops (hardway.kernels.c_loops)")
    parser.add_argument("--c-loop-int8-rows", action="store_true",
                        help="also time the C loops with the input row rounded to int8 (AVX512-VNNI only)")
    parser.add_argument("--c-loop-one-call-a-layer", action="store_true",
                        help="also time the C loops with one call a layer (the calls that share a row not merged)")
    parser.add_argument("--table", type=Path, default=TABLE, help="where to write the table as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp()
    gguf_path = smollm2_gguf(workdir)
    folder = checkpoint(MODEL)
    ids = prompt_ids(folder, args.prompt_tokens)  # (1, T)
    n = args.new_tokens

    formats = {"fp32": load(gguf_path), "int8, per row": quantize_linears(load(gguf_path), 8),
               "int8, groups of 32": quantize_linears(load(gguf_path), 8, 32),
               "int4, groups of 32": quantize_linears(load(gguf_path), 4, 32),
               "int4, groups of 64": quantize_linears(load(gguf_path), 4, 64),
               "Q4_1, the file's blocks": gguf_quantized(gguf_path)}
    timed_formats = [name for name in formats if name not in args.untimed]
    sizes = {name: weights_nbytes(m) for name, m in formats.items()}

    from transformers import AutoTokenizer
    _, text = eval_text()
    corpus = AutoTokenizer.from_pretrained(folder)(text[:200_000], return_tensors="pt").input_ids[0, :args.ppl_tokens]
    quality = {}
    with torch.inference_mode():
        for name, m in formats.items():
            quality[name] = perplexity(window_nlls(lambda x, m=m: forward_once(m, x), corpus, 512, 256))

    def compiled_run(m, backend=None):  # a model's own compiled step and static cache, as a run to time
        if backend is not None:
            lay_out_for_decode(m, compiled=True)  # the layout hardway.load chooses for the compiled step
        step = StaticDecodeStep(m, max_len=ids.shape[1] + n, backend=backend)
        return lambda: step.generate(ids, n, eos_token_id=None)

    fns = {name: compiled_run(formats[name]) for name in timed_formats}
    scored = {}  # a timed engine -> the format whose perplexity is its own
    if c_loops_available() and not args.no_c_loop:  # the same weights, one row through hardway.kernels.c_loops' C loops
        rounding = args.c_loop_int8_rows and c_loops_quantize_activations()  # the integer loops, where they run
        variants = [("", False, True)] + [(", one call a layer", False, False)] * args.c_loop_one_call_a_layer
        variants += [(", int8 row", True, True)] * rounding
        for name, bits, group in [("int8, per row", 8, None), ("int8, groups of 32", 8, 32),
                                  ("int4, groups of 32", 4, 32)]:
            for suffix, quantize_x, grouped in variants:
                m = quantize_linears(load(gguf_path), bits, group)
                for layer in m.modules():
                    if isinstance(layer, QuantizedLinear):
                        layer.use_c_loop(quantize_activations=quantize_x)
                row = f"{name}, C loop{suffix}"
                fns[row] = compiled_run(m, c_loop_decode_backend if grouped else None)
                scored[row] = name
            if rounding:  # the integer loops' own perplexity: each quantized layer's input rounded as they round it
                m = formats[name]
                hooks = [layer.register_forward_pre_hook(lambda layer, args: (round_activations(args[0]),))
                         for layer in m.modules() if isinstance(layer, QuantizedLinear)]
                with torch.inference_mode():
                    quality[f"{name}, C loop, int8 row"] = perplexity(
                        window_nlls(lambda x: forward_once(m, x), corpus, 512, 256))
                for hook in hooks:
                    hook.remove()
    if args.eager:
        fp32_eager = load(gguf_path)
        fns["fp32, eager"] = lambda: generate(fp32_eager, ids, max_new_tokens=n, eos_token_id=None)
        for bits, group in [(8, None), (4, 32)]:
            m = quantize_linears(load(gguf_path), bits, group)
            for layer in m.modules():
                if isinstance(layer, QuantizedLinear):
                    layer.use_kernel()
            fns[f"int{bits}, torch's kernel, eager"] = (
                lambda m: lambda: generate(m, ids, max_new_tokens=n, eos_token_id=None))(m)
            scored[f"int{bits}, torch's kernel, eager"] = "int8, per row" if bits == 8 else "int4, groups of 32"
        scored["fp32, eager"] = "fp32"
    if args.llama_cpp_path:
        files = {"llama.cpp Q4_1 (the file)": str(gguf_path)}
        if args.llama_cpp_f32:
            files["llama.cpp Q8_0 (its quantizer)"] = llama_cpp_q8_0(args.llama_cpp_f32, workdir, args.llama_cpp_path)
            files["llama.cpp F32"] = args.llama_cpp_f32
        for name, file in files.items():
            run = llama_cpp_generate(file, args.llama_cpp_path, args.threads)
            fns[name] = (lambda r: lambda: r(ids, n))(run)
            sizes[name] = (Path(file).stat().st_size, None)
            quality[name] = perplexity(window_nlls(llama_cpp_logits(file, args.llama_cpp_path, args.threads),
                                                   corpus, 512, 256))

    read_buffer = torch.ones(2**30 // 4, dtype=torch.float32)  # 1 GiB: the read bandwidth in the same rounds
    times, outs = time_interleaved({**fns, "read": read_buffer.sum}, "cpu", args.reps)
    read_bw = read_buffer.nbytes / statistics.median(times.pop("read"))
    del outs["read"], read_buffer
    tps = {name: n / statistics.median(t) for name, t in times.items()}
    reference = outs["fp32"][0, ids.shape[1]:]
    loadavg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{MODEL} from {gguf_path.name}; CPU, {torch.get_num_threads()} threads, load average {loadavg}; "
          f"read bandwidth (a 1 GiB sum, same rounds) {read_bw / 1e9:.1f} GB/s")
    print(f"prompt {args.prompt_tokens} tokens, {n} new tokens, {args.reps} interleaved timed runs after a warm-up; "
          f"perplexity on {len(corpus)} tokens of the course text (windows of 512, stride 256), llama.cpp's on the "
          f"same windows; every hardway row decodes with lesson 12's compiled step unless its name says eager")
    rows = []
    for name in [n for n in formats if n not in tps] + list(tps):  # scored, not timed, first
        stored, read = sizes[scored.get(name, name)]
        ppl = quality.get(name, quality.get(scored.get(name)))
        rows.append({"format": name, "stored_mb": round(stored / 1e6, 1),
                     "read_mb": None if read is None else round(read / 1e6, 1),
                     "tok_s": round(tps[name], 1) if name in tps else None,
                     "x_fp32": round(tps[name] / tps["fp32"], 2) if name in tps else None,
                     "perplexity": None if ppl is None else round(ppl, 3),
                     "vs_fp32": None if ppl is None else round(ppl / quality["fp32"] - 1, 4),
                     "agree": (outs[name][0, ids.shape[1]:] == reference).long().cumprod(0).sum().item()
                     if name in tps else None})
    print("| format | weights stored | read per token | decode tok/s | x fp32 | perplexity | vs fp32 | new tokens as fp32's |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['stored_mb']:.1f} MB | {cell(r['read_mb'], '{:.1f} MB')} | "
              f"{cell(r['tok_s'], '{:.1f}')} | {cell(r['x_fp32'], '{:.2f}')} | {cell(r['perplexity'], '{:.3f}')} | "
              f"{cell(r['vs_fp32'], '{:+.2%}')} | {cell(r['agree'], '{} of ' + str(n))} |")
    write_table(args.table, {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": loadavg, "read_bandwidth_gb_s": round(read_bw / 1e9, 1),
        "command": " ".join(["benchmarks/quant.py"] + [Path(a).name if os.path.isabs(a) else a  # no local paths
                                                       for a in (sys.argv[1:] if argv is None else argv)]),
        "new_tokens": n, "ppl_tokens": len(corpus), "rows": rows})
    return {"tok_s": tps, "perplexity": quality}


if __name__ == "__main__":
    main()
