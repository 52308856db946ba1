"""One prepared GPU check: Llama-3.2-1B's architecture on a CUDA GPU, every CUDA branch of lessons 10-12, of `hardway
verify`'s checks and of the decode benchmark, and one summary table at the end. It needs no network.

    PYTHONPATH=. python benchmarks/gpu_check.py              # a CUDA GPU: the real config, a few minutes on an H200
    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run    # anywhere: a tiny config on CPU, every step but CUDA's

The weights are seeded random bf16 (transformers' initialisation, generated on the device), written once to a
temporary checkpoint folder that hardway and transformers both load, so the loaders are exercised too. Speed does
not depend on the weights' values; agreement with transformers does not either: the same computation gives the same
numbers whatever they are. What it runs, in order, one model pair on the device at a time:

1. fp32: transformers' last-token logits on the prompt (the reference both half precisions are measured against),
   then hardway's static-shape compiled step against its own eager decoding: tokens must be identical.
2. fp16 and bf16, eager, with one SDPA backend pinned for both sides (hardway.verify.ritual.comparison_attention): greedy
   tokens identical to transformers', the last-token logits no further from fp32 than transformers' own (give or
   take one rounding step of the dtype), perplexity.
3. bf16 speed (32-token prompt, 128 new tokens, batch 1): transformers' generate, hardway.generate and
   the compiled step, timed like benchmarks/decode.py (a full-length warm-up, interleaved runs, CUDA events,
   medians); compile time, CUDA graphs recorded, recompilations; compiled vs eager teacher-forced (half precision
   rounds differently once inductor fuses ops); the roofline from a copy bandwidth measured in the same run; peak
   memory.

Exit status 0 when every check passes, 1 when one fails (the table is printed either way), 2 without CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach for the hub

import standins  # noqa: E402  (tools/: Llama-3.2-1B's config.json and the random-weights recipe)
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import hardway  # noqa: E402
from hardway.decode.static import StaticDecodeStep
from hardway.instruments.roofline import measure_bandwidth, roofline_tokens_per_s
from hardway.instruments.agreement import teacher_forced_agreement
from hardway.instruments.memory import weight_bytes  # noqa: E402
from hardway.instruments.timing import sync_device, time_interleaved  # noqa: E402
from hardway.verify.ritual import comparison_attention, half_precision_bar, load_reference, perplexity, window_nlls

# A Llama of the same kind (GQA, tied head, llama3 RoPE scaling), small enough to run every step on a CPU in seconds.
TINY_CONFIG = dict(standins.LLAMA_1B_CONFIG, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                   rope_scaling=dict(standins.LLAMA_1B_CONFIG["rope_scaling"], original_max_position_embeddings=64),
                   bos_token_id=1, eos_token_id=2, initializer_range=0.2)
H200_TARGET_TOK_S = 1300  # compiled, bf16, batch 1, 32-token prompt, 128 new tokens
TEACHER_FORCED_MIN_AGREEMENT = 0.95  # compiled vs eager argmax in half precision: only near-ties may flip


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_checkpoint(folder: Path, config: dict, device) -> None:
    """config.json and model.safetensors with seeded random bf16 weights generated on `device`."""
    from safetensors.torch import save_file

    tensors = standins.random_llama_weights(config, seed=0, device=device)
    save_file({name: t.cpu() for name, t in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def free(device) -> None:
    """Drop what the last pair left behind, so that the next one starts from an empty device."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> str:
    if torch.device(device).type != "cuda":
        return "n/a (CPU)"
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"


def cuda_graphs_recorded(device) -> int | None:
    """The CUDA graphs inductor's CUDA-graph trees have recorded on `device` (None on CPU)."""
    if torch.device(device).type != "cuda":
        return None
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(torch.device(device).index or 0, create_if_none_exists=False)
    if manager is None:
        return 0
    nodes = [node for roots in manager.roots.values() for node in roots]
    n = 0
    while nodes:
        node = nodes.pop()
        n += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return n


class Table:
    """The summary: one row per check, PASS / FAIL for those with a target, "info" for the others."""

    def __init__(self):
        self.rows = []

    def add(self, name: str, measured: str, target: str = "", passed: bool | None = None) -> None:
        self.rows.append((name, "info" if passed is None else "PASS" if passed else "FAIL", measured, target))
        log(f"  {name}: {measured}" + (f"  [{self.rows[-1][1]}]" if passed is not None else ""))

    @property
    def passed(self) -> bool:
        return all(result != "FAIL" for _, result, _, _ in self.rows)

    def format(self) -> str:
        widths = [max(len(row[i]) for row in self.rows + [("check", "result", "measured", "target")]) for i in range(4)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(("check", "result", "measured", "target"), widths))]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in self.rows]
        return "\n".join(lines)


def new_tokens(a: torch.Tensor, b: torch.Tensor, T: int) -> str:
    """'n of n identical', or where the first difference is."""
    if a.shape == b.shape and torch.equal(a.cpu(), b.cpu()):
        return f"{a.shape[1] - T} of {a.shape[1] - T} identical"
    n = min(a.shape[1], b.shape[1])
    diff = (a[:, :n].cpu() != b[:, :n].cpu()).any(dim=0).nonzero()
    return f"first difference at new token {int(diff[0]) - T if len(diff) else n - T}"


def compiled_step(model, max_len: int, dry_run: bool):
    """StaticDecodeStep: inductor with CUDA graphs on a GPU; on CPU (dry run) AOTAutograd without code generation,
    so that tracing, functionalization and the graph count are exercised in seconds."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager") if dry_run else None
    step = StaticDecodeStep(model, max_len, backend=counter) if dry_run else StaticDecodeStep(model, max_len)
    return step, counter


def compilations(counter) -> int:
    return counter.frame_count if counter is not None else counters["stats"]["unique_graphs"]


@torch.inference_mode()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny config on CPU: every step but the CUDA ones")
    parser.add_argument("--device", default="cuda", help="the GPU to check (default cuda); ignored with --dry-run")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per timed generation")
    parser.add_argument("--check-tokens", type=int, default=50, help="greedy tokens compared with transformers")
    parser.add_argument("--reps", type=int, default=5, help="timed runs of each generation, after a warm-up")
    args = parser.parse_args(argv)
    dry_run = args.dry_run
    device = "cpu" if dry_run else args.device
    if not dry_run and not (torch.device(device).type == "cuda" and torch.cuda.is_available()):
        print(f"gpu_check: no CUDA device {device!r} here; `--dry-run` runs every step but the CUDA ones on CPU",
              file=sys.stderr)
        return 2
    if dry_run:
        args.prompt_tokens, args.new_tokens, args.check_tokens, args.reps = 8, 10, 10, 1
    else:  # gpt-fast's setting: inductor tunes each generated kernel's launch shape (longer compile, faster steps)
        torch._inductor.config.coordinate_descent_tuning = True
    config = TINY_CONFIG if dry_run else standins.LLAMA_1B_CONFIG
    started = time.perf_counter()
    torch.manual_seed(0)
    table = Table()
    name = ("dry run, tiny Llama, CPU" if dry_run else f"Llama-3.2-1B architecture, {torch.cuda.get_device_name(device)}, "
            "inductor with coordinate-descent tuning")
    log(f"gpu_check: {name}; torch {torch.__version__}")

    T, n_check = args.prompt_tokens, args.check_tokens
    ids = torch.randint(0, config["vocab_size"], (1, T), generator=torch.Generator().manual_seed(0)).to(device)  # (1, T)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        write_checkpoint(folder, config, device)
        table.add("random checkpoint", f"{sum(p.stat().st_size for p in folder.iterdir()) / 1e6:,.1f} MB written "
                  f"in {time.perf_counter() - t0:.0f} s")

        # 1. fp32: the reference logits, and the compiled step against eager (identical tokens in fp32).
        log("fp32: transformers' reference logits; hardway compiled vs eager")
        theirs = load_reference(folder, device=device, dtype=torch.float32)
        with comparison_attention():
            reference_logits = theirs(ids).logits[:, -1].float()  # (1, V)
        del theirs
        free(device)
        ours = hardway.load(folder, device=device, dtype=torch.float32)
        step, counter = compiled_step(ours, T + n_check, dry_run)
        eager_ids = hardway.generate(ours, ids, n_check, eos_token_id=None)  # (1, T + n_check)
        compiled_ids = step.generate(ids, n_check, eos_token_id=None)
        compiled_ids = step.generate(ids, n_check, eos_token_id=None)  # a replay
        table.add("fp32 compiled vs eager tokens", new_tokens(compiled_ids, eager_ids, T), f"{n_check} identical",
                  torch.equal(compiled_ids, eager_ids))
        del ours, step
        free(device)

        # 2. fp16 and bf16 against transformers, eager, one SDPA backend for both sides.
        for dtype in (torch.float16, torch.bfloat16):
            short = str(dtype).removeprefix("torch.")
            log(f"{short}: hardway vs transformers, eager")
            ours = hardway.load(folder, device=device, dtype=dtype)
            theirs = load_reference(folder, device=device, dtype=dtype)
            with comparison_attention():
                a = hardway.generate(ours, ids, n_check, eos_token_id=None)
                b = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_check, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
                table.add(f"{short} greedy tokens vs transformers", new_tokens(a, b, T), f"{n_check} identical",
                          torch.equal(a.cpu(), b.cpu()))
                ours_logits = ours(ids, last_only=True)[:, -1].float()  # (1, V)
                theirs_logits = theirs(ids).logits[:, -1].float()  # (1, V)
                ours_gap = (ours_logits - reference_logits).abs().max().item()
                theirs_gap = (theirs_logits - reference_logits).abs().max().item()
                delta = (ours_logits - theirs_logits).abs().max().item()
                bar = half_precision_bar(theirs_gap, reference_logits, dtype)
                table.add(f"{short} logits: max |Δ| from fp32", f"hardway {ours_gap:.3g}, transformers {theirs_gap:.3g} "
                          f"(hardway vs transformers {delta:.3g})", f"hardway ≤ transformers + 1 step = {bar:.3g}",
                          ours_gap <= bar)
                text = torch.randint(0, config["vocab_size"], (4 * T,), generator=torch.Generator().manual_seed(1))
                text = text.to(device)  # (4T,) random ids: perplexity compares the two models, not the text
                pa = perplexity(window_nlls(lambda x: ours(x), text, 2 * T, T))
                pb = perplexity(window_nlls(lambda x: theirs(x).logits, text, 2 * T, T))
                table.add(f"{short} perplexity", f"{pa:.4f} vs {pb:.4f} (rel. {abs(pa - pb) / pb:.2g})", "within 1e-2",
                          abs(pa - pb) / pb <= 1e-2)
            if dtype == torch.float16:
                table.add(f"{short} peak memory (one pair)", peak_memory(device))
                del ours, theirs
                free(device)

        # 3. bf16 speed: transformers eager, hardway eager, hardway compiled (the pair from step 2 is still loaded).
        log("bf16: speed (this compiles the step: a minute or two on a GPU)")
        n = args.new_tokens
        max_len = T + n
        step, counter = compiled_step(ours, max_len, dry_run)
        t0 = time.perf_counter()
        step.generate(ids, n, eos_token_id=None)  # compiles, warms up; the CUDA graph is recorded on the next call
        step.generate(ids, n, eos_token_id=None)
        sync_device(device)
        table.add("compile + record time", f"{time.perf_counter() - t0:.1f} s (first two generations)")

        def run_theirs():
            return theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)

        runs = {"transformers eager": run_theirs,
                "hardway eager": lambda: hardway.generate(ours, ids, n, eos_token_id=None),
                "hardway compiled": lambda: step.generate(ids, n, eos_token_id=None)}
        seconds, outs = time_interleaved(runs, device, args.reps)
        tok_s = {k: n / statistics.median(v) for k, v in seconds.items()}
        bandwidth = measure_bandwidth(device, mib=64 if dry_run else None)
        roofline = roofline_tokens_per_s(weight_bytes(ours), bandwidth)
        table.add("copy bandwidth, roofline", f"{bandwidth / 1e9:.0f} GB/s; {weight_bytes(ours) / 1e9:.2f} GB of "
                  f"weights -> {roofline:.0f} tok/s")
        for k, v in tok_s.items():
            table.add(f"bf16 {k}", f"{v:.1f} tok/s ({v / roofline:.0%} of roofline)")
        table.add("hardway eager vs transformers eager", f"{tok_s['hardway eager'] / tok_s['transformers eager']:.2f}x",
                  "≥ 1.00x", None if dry_run else tok_s["hardway eager"] >= tok_s["transformers eager"])
        h200 = not dry_run and "H200" in torch.cuda.get_device_name(device)
        table.add("bf16 compiled tok/s target", f"{tok_s['hardway compiled']:.0f} tok/s",
                  f"≥ {H200_TARGET_TOK_S} on an H200" if h200 else "(H200 only)",
                  tok_s["hardway compiled"] >= H200_TARGET_TOK_S if h200 else None)
        graphs = cuda_graphs_recorded(device)
        table.add("CUDA graphs recorded", "n/a (CPU)" if graphs is None else str(graphs), "1",
                  None if graphs is None else graphs == 1)
        skips = counters["inductor"]["cudagraph_skips"]
        table.add("compilations of the step", f"{compilations(counter)} graph(s), {skips} CUDA-graph skip(s)", "1, 0",
                  compilations(counter) == 1 and skips == 0)
        agreement, max_delta = teacher_forced_agreement(ours, step, outs["hardway eager"], T)
        table.add("bf16 compiled vs eager, teacher-forced", f"argmax agreement {agreement:.1%}, max |Δ logits| "
                  f"{max_delta:.3g}", f"≥ {TEACHER_FORCED_MIN_AGREEMENT:.0%}", agreement >= TEACHER_FORCED_MIN_AGREEMENT)
        table.add("bf16 compiled vs eager, free-running", new_tokens(outs["hardway compiled"], outs["hardway eager"], T))
        table.add("bf16 peak memory (pair + compiled step)", peak_memory(device))
        del ours, theirs, step
        free(device)

    table.add("total time", f"{time.perf_counter() - started:.0f} s", "< 480 s" if not dry_run else "",
              None if dry_run else time.perf_counter() - started < 480)
    print(f"\ngpu_check summary: {name}; prompt {T} tokens, {n} new tokens, {n_check} compared; torch {torch.__version__}")
    print(table.format())
    return 0 if table.passed else 1


if __name__ == "__main__":
    sys.exit(main())
