"""Speculative decoding (lesson 18): tokens per second of plain decoding and of speculative decoding with each
drafter and k, side by side in one process, on prompts whose answer quotes the prompt (grounded) and open-ended
ones, with transformers' prompt lookup (`generate(prompt_lookup_num_tokens=k)`) and assisted generation
(`generate(assistant_model=...)`, its assistant the model's int8 copy made by torch's dynamic quantization) on the
same prompts and weights.

    uv run python benchmarks/speculative.py                      # the README's table
    uv run python benchmarks/speculative.py --reps 1 --new-tokens 48 --ks 2,4   # a quick look

SmolLM2-135M-Instruct (the stand-in has its real weights), fp32, CPU, batch 1, greedy, each prompt in its chat
template, generation until the end of the answer or --new-tokens. Two paths, each speculative run against plain
decoding on the same path: lesson 08's eager steps (`generate`, `speculative_generate`), and lesson 12's compiled
step (`StaticDecodeStep`, the fastest plain decoding of the course) with lesson 22's `CompiledVerifier` for prompt
lookup (one more graph per k, its products of k + 1 rows by oneDNN on a packed copy of the weights, lesson 22's
`with_onednn_linears`; `--no-onednn` lowers them by `rows_times_matrix` instead; `--no-compile` skips them). Besides
a constant k (every draft padded to k on the compiled path), two schedules that choose the guesses step by step, up
to the largest k: transformers' heuristic (`HeuristicGuesses`) and the cost-aware choice (`CostAwareGuesses`, from
the verify costs this run measures first, per path); on the compiled path they run the smallest graph of --ks that
holds each draft. Every speculative output is asserted identical to plain decoding's tokens. Times: one warm-up of
every configuration (the compilations happen there), then --reps interleaved rounds, medians. Acceptance is kept
guesses over guesses, tokens per step is new tokens per verify step; each kind of prompt sums its prompts' new tokens
and median times.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardway.text.chat import ChatTemplate  # noqa: E402
from hardway.decode.generate import generate  # noqa: E402
from hardway.formats.hub import checkpoint  # noqa: E402
from hardway.loading import load  # noqa: E402
from hardway.decode.speculative import (CompiledVerifier, PromptLookupDrafter, SpeculationStats, Verifier, int8_drafter, speculative_generate)
from hardway.instruments.speculation import CostAwareGuesses, HeuristicGuesses, measure_verify_costs
from hardway.kernels.onednn import MergedLinear, OneDNNLinear  # noqa: E402
from hardway.instruments.timing import time_interleaved  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PASSAGE = ("The Moon is Earth's only natural satellite. It orbits at an average distance of 384,400 km, about 30 "
           "times the diameter of Earth. The Moon always shows the same side to Earth, because tidal forces have "
           "slowed its rotation until it matches its orbit. Its gravity causes the tides of the oceans.")
CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    total = 0\n"
        "    for value in values:\n        total += (value - m) ** 2\n    return total / len(values)\n")
PROMPTS = {  # name -> (kind, the user's message)
    "repeat a passage": ("grounded", "Repeat the following text exactly, word for word:\n\n" + PASSAGE),
    "add docstrings": ("grounded", "Add a docstring to each function of this Python code:\n\n" + CODE),
    "rename a variable": ("grounded", "Rewrite this Python code, renaming the variable `total` to `acc`:\n\n" + CODE),
    "a story": ("open-ended", "Write a short story about a robot who learns to paint."),
    "the sky": ("open-ended", "Explain why the sky is blue."),
}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def transformers_runs(folder, ks, int8_ks):
    """{name: ids (1, T) -> ids (1, T + n)}: transformers' greedy generate, with prompt lookup, and assisted by the
    model's int8 copy (torch's dynamic quantization of every Linear), a constant number of guesses per step."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assistant = torch.ao.quantization.quantize_dynamic(copy.deepcopy(hf), {torch.nn.Linear}, dtype=torch.qint8)
    assistant.generation_config.num_assistant_tokens_schedule = "constant"  # k guesses every step, as ours

    def run(ids, n, **kw):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)

    fns = {"transformers": lambda ids, n: run(ids, n)}
    for k in ks:
        fns[f"transformers lookup k={k}"] = lambda ids, n, k=k: run(ids, n, prompt_lookup_num_tokens=k)
    for k in int8_ks:
        def assisted(ids, n, k=k):
            assistant.generation_config.num_assistant_tokens = k
            return run(ids, n, assistant_model=assistant)
        fns[f"transformers int8 assistant k={k}"] = assisted
    return fns


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=96, help="at most this many new tokens per answer")
    parser.add_argument("--reps", type=int, default=2, help="interleaved timed rounds after the warm-up")
    parser.add_argument("--ks", type=ints, default=[1, 2, 4, 8], help="guesses per step for prompt lookup")
    parser.add_argument("--int8-ks", type=ints, default=[2, 4], help="guesses per step for the int8 drafter")
    parser.add_argument("--no-schedules", action="store_true", help="constant k only: no heuristic or cost-aware rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-transformers", action="store_true", help="hardway's runs only")
    parser.add_argument("--no-compile", action="store_true",
                        help="eager runs only (no compiled plain step, no compiled verify step)")
    parser.add_argument("--no-onednn", action="store_true",
                        help="the compiled verify step's products by rows_times_matrix, not oneDNN")
    parser.add_argument("--prompts", default=None, help="comma-separated names of PROMPTS to run (default all)")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.reps < 1 or args.threads < 1 or not args.ks or min(args.ks + args.int8_ks) < 1:
        parser.error("--new-tokens must be at least 2, --reps, --threads and every k at least 1")
    torch.set_num_threads(args.threads)
    names = list(PROMPTS) if args.prompts is None else args.prompts.split(",")
    unknown = [n for n in names if n not in PROMPTS]
    if unknown:
        parser.error(f"unknown prompts {unknown}; known: {list(PROMPTS)}")

    folder = checkpoint(MODEL)
    model = load(folder)
    chat = ChatTemplate.from_folder(folder)
    drafters = {"lookup": PromptLookupDrafter(), "int8": int8_drafter(model)}
    theirs = {} if args.no_transformers else transformers_runs(folder, args.ks, args.int8_ks)
    n = args.new_tokens
    configs = [("lookup", k) for k in args.ks] + [("int8", k) for k in args.int8_ks]
    k_max = max(args.ks)

    prompt_ids = {name: torch.tensor([chat.encode([{"role": "user", "content": PROMPTS[name][1]}],
                                                  add_generation_prompt=True)]) for name in names}  # (1, T) each
    longest = max(ids.shape[1] for ids in prompt_ids.values()) + n
    pos = min(ids.shape[1] for ids in prompt_ids.values()) + n // 2  # where the verify costs are measured
    costs = {"eager": measure_verify_costs(Verifier(model, longest + k_max), args.ks, pos, reps=5)}
    step, verifiers, multi = None, {}, None
    if not args.no_compile:  # one compiled step for every prompt: its static cache holds the longest and k guesses
        from hardway.decode.static import StaticDecodeStep  # lesson 12; imported here: inductor is slow to import

        step = StaticDecodeStep(copy.deepcopy(model), max_len=longest + k_max)
        # lesson 18: a graph of k + 1 positions for every k
        multi = CompiledVerifier(step, k_max, sizes=args.ks, onednn=not args.no_onednn)
        packed = sum(m.packed.nbytes for m in multi.rows_model.modules() if isinstance(m, (OneDNNLinear, MergedLinear)))
        print(f"compiled verify step: products by {'rows_times_matrix' if args.no_onednn else 'oneDNN'}; "
              f"packed copy of the weights {packed / 2**20:.0f} MiB", flush=True)
        verifiers = {k: multi.restricted_to([k]) for k in args.ks}  # constant k: every draft padded to k
        costs["compiled"] = measure_verify_costs(multi, args.ks, pos, reps=5)  # the graphs compile here
    print(f"verify step of m guesses / a step without: load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for path, table in costs.items():
        print(f"  {path}: " + ", ".join(f"m={m} {c:.2f}x" for m, c in table.items()), flush=True)
    schedules = {} if args.no_schedules else {
        "heuristic": lambda path: HeuristicGuesses(k_max), "cost-aware": lambda path: CostAwareGuesses(costs[path])}

    results = {}  # (prompt, config name) -> (seconds, new tokens, stats or None, same tokens as plain)
    for name in names:
        kind, ids = PROMPTS[name][0], prompt_ids[name]
        T = ids.shape[1]
        fns = {"hardway": lambda ids=ids: (generate(model, ids, max_new_tokens=n), None)}
        if step is not None:
            fns["hardway compiled"] = lambda ids=ids: (step.generate(ids, n), None)
        for drafter_name, k in configs:
            def spec(ids=ids, drafter=drafters[drafter_name], k=k):
                stats = SpeculationStats()
                return speculative_generate(model, ids, drafter, k, max_new_tokens=n, stats=stats), stats
            fns[f"hardway {drafter_name} k={k}"] = spec
        for schedule_name, schedule in schedules.items():
            def adaptive(ids=ids, schedule=schedule("eager")):
                stats = SpeculationStats()
                return speculative_generate(model, ids, drafters["lookup"], schedule, max_new_tokens=n,
                                            stats=stats), stats
            fns[f"hardway lookup {schedule_name} k<={k_max}"] = adaptive
        for k, verifier in verifiers.items():
            def compiled_spec(ids=ids, k=k, verifier=verifier):
                stats = SpeculationStats()
                return speculative_generate(step.model, ids, drafters["lookup"], k, max_new_tokens=n, stats=stats,
                                            verifier=verifier), stats
            fns[f"hardway compiled lookup k={k}"] = compiled_spec
        for schedule_name, schedule in (schedules.items() if step is not None else ()):
            def compiled_adaptive(ids=ids, schedule=schedule("compiled")):
                stats = SpeculationStats()
                return speculative_generate(step.model, ids, drafters["lookup"], schedule, max_new_tokens=n,
                                            stats=stats, verifier=multi), stats
            fns[f"hardway compiled lookup {schedule_name} k<={k_max}"] = compiled_adaptive
        for label, fn in theirs.items():
            fns[label] = lambda ids=ids, fn=fn: (fn(ids, n), None)
        times, outs = time_interleaved(fns, reps=args.reps)
        plain = outs["hardway"][0]
        for label, (out, stats) in outs.items():
            same = torch.equal(out, plain)
            if label.startswith("hardway") and not same:
                raise SystemExit(f"{label} on {name!r}: the tokens differ from plain decoding's")
            results[(name, label)] = (statistics.median(times[label]), out.shape[1] - T, stats, same)
        print(f"{name} ({kind}, {T}-token prompt, {plain.shape[1] - T} new tokens): "
              + ", ".join(f"{label} {results[(name, label)][1] / results[(name, label)][0]:.1f}"
                          for label in fns) + " tok/s", flush=True)

    loadavg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{MODEL}, fp32, CPU, {torch.get_num_threads()} threads, batch 1, greedy; load average {loadavg}; "
          f"up to {n} new tokens, {args.reps} interleaved rounds after a warm-up, medians")
    labels = list(dict.fromkeys(label for _, label in results))
    compiled = step is not None
    print("\n| prompts | decoding | tok/s | x hardway plain | " + ("x hardway compiled plain | " if compiled else "")
          + "guesses kept | tokens per step | same tokens |")
    print("|---|---|---|---|---|---|---|" + ("---|" if compiled else ""))

    def tok_per_s(group, label):
        return sum(results[(g, label)][1] for g in group) / sum(results[(g, label)][0] for g in group)

    for kind in dict.fromkeys(PROMPTS[n_][0] for n_ in names):
        group = [n_ for n_ in names if PROMPTS[n_][0] == kind]
        base = tok_per_s(group, "hardway")
        compiled_base = tok_per_s(group, "hardway compiled") if compiled else None
        for label in labels:
            rows = [results[(g, label)] for g in group]
            tok_s = tok_per_s(group, label)
            stats = [r[2] for r in rows if r[2] is not None]
            kept = (f"{sum(sum(s.kept) for s in stats) / max(sum(sum(s.drafted) for s in stats), 1):.0%}"
                    if stats else "-")
            per_step = (f"{sum(sum(s.kept) + s.steps for s in stats) / sum(s.steps for s in stats):.2f}"
                        if stats else "-")
            same = f"{sum(r[3] for r in rows)} of {len(rows)}"
            versus_compiled = f"{tok_s / compiled_base:.2f} | " if compiled else ""
            print(f"| {kind} ({len(group)}) | {label} | {tok_s:.1f} | {tok_s / base:.2f} | {versus_compiled}{kept} | "
                  f"{per_step} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
