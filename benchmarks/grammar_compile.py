"""Compiling big grammars (lesson 25, section 9): time and memory against xgrammar, and what compiles cost the others.

    uv run python benchmarks/grammar_compile.py                     # (a) the compile table
    uv run python benchmarks/grammar_compile.py --before bab6626    # (a) with the code of that commit beside it
    uv run python benchmarks/grammar_compile.py --serve             # (b) 8 plain clients, alone and beside a 9th
    uv run python benchmarks/grammar_compile.py --serve --requests 1 --max-tokens 8 --reps 1   # (b), a quick look
    uv run python benchmarks/grammar_compile.py --gil               # (c) a decode step beside compiles

Three schemas a client may send in `response_format` or a tool's parameters: an enum of 5,000 strings (random
lowercase words of 4 to 12 letters), an object of 40 optional string properties, an object of 20 optional integer
properties. SmolLM2-135M-Instruct's tokenizer (49,152 tokens).

(a) the compile table: each schema compiled in a process of its own, once the tokenizer (and our vocabulary trie, or
xgrammar's TokenizerInfo) is loaded: the time of what a server does before the first token, and the peak resident
memory above the memory at its start (Linux's VmHWM, reset there). Ours: `compile_json_schema`, which computes the
first masks too (the server's path), and the start's mask; with --before COMMIT, the same calls on that commit's
`hardway` (git archive), beside it.
xgrammar: `compile_json_schema` (one thread, no cache, any_whitespace=False), a GrammarMatcher and its first
bitmask. Medians over --repeats processes (memory: the largest). Then, for ours, the lazy work left to the engine:
random generations under each grammar (random scores, closing tokens favoured), every mask timed the first time its
state is visited (in a process whose objects are frozen out of the garbage collector, as `hardway serve` does), the
states made in all, and, for scale, the states of the whole (unminimized) DFA.

(b) --serve: `hardway serve` on SmolLM2 (lesson 14's engine, no prefix cache). 8 clients each send --requests chat
requests one after the other (greedy, --max-tokens), all starting together; their output tokens over the wall time
is the round's tok/s. Three kinds of round, interleaved, --reps of each, on the same prompts: the 8 alone; the 8
while a 9th client keeps sending the three schemas as `response_format`, the same three again and again (compiled
once, then cached: what the 9th's own requests cost the engine); and the same with a new title each time, so that
every request of the 9th is compiled afresh. It starts a request every --ninth-every seconds (1 by default; 0: back
to back), the same rate in both, and its answers are --ninth-max-tokens long (1 by default: the compile and one
step). New against alone is what a stream of new schemas costs everyone else; cached against alone, what the 9th's
requests cost the engine (each a prompt to prefill, in a step off the compiled decode path); new against cached,
what the compiles cost.

(c) --gil: the mechanism under (b), without HTTP: a decode step of 8 rows of SmolLM2 (eager, lesson 08's cache),
timed alone, then while another thread compiles new enums back to back (the worst case: a compile all the time):
as the server's grammar thread runs (its priority lowered, the GIL let go every 0.2 ms), at the engine's priority
with the GIL let go, and at the engine's priority keeping the GIL until Python's switch interval takes it away.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import random
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parent.parent


def schemas() -> dict[str, dict]:
    """The three schemas (tests/test_grammar_budget.py makes the same)."""
    rng = random.Random(0)
    words: set[str] = set()
    while len(words) < 5000:
        words.add("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 12))))
    return {"enum of 5,000 strings": {"enum": sorted(words)},
            "40 optional strings": {"type": "object",
                                    "properties": {f"field_{i}": {"type": "string"} for i in range(40)}},
            "20 optional integers": {"type": "object",
                                     "properties": {f"count_{i}": {"type": "integer"} for i in range(20)}}}


def status_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS: resident now; VmHWM: the peak since the last reset), in MB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def reset_peak() -> float:
    """Start measuring the peak resident memory from here (Linux: writing 5 to clear_refs resets VmHWM) -> the
    resident memory now, in MB."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mb("VmRSS")


# ---------------------------------------------------------------- (a) one compile, in a child process


def child(impl: str, name: str, walks: int) -> dict:
    """Compile one schema with one implementation, in this fresh process -> its figures."""
    from hardway.formats.hub import checkpoint
    folder = checkpoint(SMOLLM2)
    schema = schemas()[name]
    if impl == "xgrammar":
        import xgrammar
        from transformers import AutoTokenizer
        info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(folder))
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        base = reset_peak()
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "peak_mb": status_mb("VmHWM") - base}
    from hardway.decode.constrained import compile_json_schema, token_vocabulary
    from hardway.text.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(folder)
    token_vocabulary(tokenizer)
    base = reset_peak()
    start = time.perf_counter()
    automaton = compile_json_schema(schema, tokenizer, [2])
    automaton.allowed(automaton.start)
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "peak_mb": status_mb("VmHWM") - base, "states": automaton.dfa.n_states}
    if impl == "ours" and walks:
        out.update(lazy_work(automaton, tokenizer, walks))
    return out


def lazy_work(automaton, tokenizer, walks: int) -> dict:
    """Random generations under the grammar: the time of every mask the first time its state is visited."""
    import numpy as np
    from hardway.decode.constrained import token_vocabulary
    gc.freeze()  # as `hardway serve` does before its engine starts
    vocabulary = token_vocabulary(tokenizer)
    closing = np.zeros(vocabulary.size)
    for token_id, data in enumerate(vocabulary.token_bytes):
        if data is not None and set(data) <= set(b'"]},: '):
            closing[token_id] = 3.0
    closing[2] = 3.0
    rng = np.random.default_rng(0)
    first_visits, tokens = [], 0
    for _ in range(walks):
        state = automaton.start
        for _ in range(200):
            new = state not in automaton._masks
            t0 = time.perf_counter()
            mask = automaton.allowed(state).numpy()
            if new:
                first_visits.append(time.perf_counter() - t0)
            token = int(np.argmax(np.where(mask, rng.standard_normal(vocabulary.size) * 2 + closing, -np.inf)))
            if token == 2:
                break
            t0 = time.perf_counter()
            state = automaton.advance(state, token)
            tokens += 1
    ms = sorted(s * 1e3 for s in first_visits)
    made = automaton.dfa.n_states
    dfa = automaton.dfa  # for scale: every state there is, made with the budget lifted (the eager construction)
    dfa.max_states, state = 10**8, 0
    while state < dfa.n_states:
        dfa.expand(state)
        state += 1
    return {"walks": walks, "tokens": tokens, "first_visits": len(ms), "first_visit_median_ms": statistics.median(ms),
            "first_visit_p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "first_visit_max_ms": ms[-1],
            "states_after_walks": made, "whole_dfa_states": dfa.n_states}


def run_child(impl: str, name: str, walks: int, path: str | None) -> dict:
    env = dict(os.environ)
    if path is not None:  # another commit's hardway first on the path
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__, "--child", impl, name, "--walks", str(walks)],
                          capture_output=True, text=True, env=env, cwd=path or ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checkout(commit: str) -> str:
    """That commit's `hardway` package, extracted into a temporary folder -> the folder."""
    folder = tempfile.mkdtemp(prefix="hardway-")
    archive = subprocess.run(["git", "archive", commit, "hardway"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    return folder


def compile_table(args) -> dict:
    from importlib.metadata import version
    impls = [("ours", None)]
    if args.before:
        impls.insert(0, (f"ours at {args.before}", checkout(args.before)))
    impls.append(("xgrammar", None))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; SmolLM2's tokenizer; xgrammar "
          f"{version('xgrammar')}; load average {os.getloadavg()[0]:.2f} at the start; medians of {args.repeats} "
          f"processes (memory: the largest)")
    print("compile: seconds / peak MB above the loaded tokenizer; ours: also the DFA states made\n")
    print("| schema | " + " | ".join(name for name, _ in impls) + " |")
    print("|---|" + "---|" * len(impls))
    results = {}
    for name in schemas():
        cells, results[name] = [], {}
        for label, path in impls:
            impl = "xgrammar" if label == "xgrammar" else "before" if path else "ours"
            runs = [run_child(impl, name, args.walks if impl == "ours" and r == 0 else 0, path)
                    for r in range(args.repeats)]
            if any("error" in r for r in runs):
                cells.append(next(r["error"] for r in runs if "error" in r)[:60])
                results[name][label] = runs
                continue
            seconds = statistics.median(r["seconds"] for r in runs)
            memory = max(r["peak_mb"] for r in runs)
            states = f" ({runs[0]['states']:,} states)" if "states" in runs[0] else ""
            cells.append(f"{seconds:.3f} s / {memory:,.0f} MB{states}")
            results[name][label] = {"seconds": seconds, "peak_mb": memory, "runs": runs}
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.walks:
        print(f"\nours, after the compile: {args.walks} random generations per schema, each mask timed the first time "
              f"its state is visited (in the engine's thread, in a server)\n")
        print("| schema | tokens | first visits | median ms | p99 ms | max ms | DFA states made in all | the whole "
              "DFA |")
        print("|---|---|---|---|---|---|---|---|")
        for name in schemas():
            lazy = results[name]["ours"]["runs"][0] if isinstance(results[name]["ours"], dict) else None
            if lazy and "first_visits" in lazy:
                print(f"| {name} | {lazy['tokens']} | {lazy['first_visits']} | {lazy['first_visit_median_ms']:.1f} | "
                      f"{lazy['first_visit_p99_ms']:.1f} | {lazy['first_visit_max_ms']:.1f} | "
                      f"{lazy['states_after_walks']:,} | {lazy['whole_dfa_states']:,} |")
    return results


# ---------------------------------------------------------------- (b) 8 clients, alone and beside a 9th


_serial = itertools.count()


def prompt_set(clients: int, requests: int) -> list[list[list[dict]]]:
    """Chats that ask for long answers, a different one each (no two prompts share their start)."""
    topics = "rivers mountains bridges libraries railways harbours deserts forests markets castles".split()
    out = []
    for _ in range(clients):
        mine = []
        for _ in range(requests):
            i = next(_serial)
            mine.append([{"role": "user", "content": f"({i}) Write a long story about {topics[i % len(topics)]} "
                                                     f"and the people who live near them."}])
        out.append(mine)
    return out


def post(url: str, body: dict) -> dict:
    import httpx
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    return r.json()


def ninth_client(url: str, stop: threading.Event, max_tokens: int, fresh: bool, every: float, record: list) -> None:
    """Sends the three schemas in turn until told to stop, a request every `every` seconds (or back to back, if one
    takes longer); `fresh`: each time with a new title, so that each is compiled afresh (else each is compiled once,
    then found in the cache)."""
    shapes = list(schemas().values())
    for k in itertools.count():
        if stop.is_set():
            return
        schema = {**shapes[k % len(shapes)], "title": f"request {next(_serial)}" if fresh else "cached"}
        body = {"model": SMOLLM2, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": "Answer in JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
        start = time.perf_counter()
        post(url, body)
        record.append(time.perf_counter() - start)
        stop.wait(max(0.0, every - (time.perf_counter() - start)))


MODES = {"alone": None, "beside, cached schemas": False, "beside, new schemas": True}  # the 9th: none, or `fresh`


def serve_round(url: str, prompts, max_tokens: int, ninth_max_tokens: int, ninth_every: float,
                fresh: bool | None) -> dict:
    tokens, latencies, stop = [], [], threading.Event()

    def client(mine):
        for messages in mine:
            answer = post(url, {"model": SMOLLM2, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
            tokens.append(answer["usage"]["completion_tokens"])

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    extra = None if fresh is None else threading.Thread(target=ninth_client,
                                                         args=(url, stop, ninth_max_tokens, fresh, ninth_every,
                                                               latencies))
    if extra:
        extra.start()
        time.sleep(0.5)  # its first schema compiling when the others start
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stop.set()
    if extra:
        extra.join()
    return {"tok_s": sum(tokens) / wall, "tokens": sum(tokens), "wall_s": wall, "ninth_requests": len(latencies),
            "ninth_median_s": statistics.median(latencies) if latencies else None}


def serve_benchmark(args) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve import free_port, start_hardway
    port = free_port()
    proc = start_hardway(SMOLLM2, port, ["--max-batch", "16", "--no-prefix-cache"])
    url = f"http://127.0.0.1:{port}"
    try:
        post(url, {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})  # warm-up
        rounds: dict[str, list] = {mode: [] for mode in MODES}
        print(f"{args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, greedy; the 9th: "
              f"the three schemas in turn, a request every {args.ninth_every:g} s, max_tokens "
              f"{args.ninth_max_tokens}; load average {os.getloadavg()[0]:.2f} at the start")
        order = list(MODES)
        for rep in range(args.reps):
            prompts = prompt_set(args.clients, args.requests)
            for mode in order[rep % len(order):] + order[:rep % len(order)]:  # each mode first in turn
                r = serve_round(url, prompts, args.max_tokens, args.ninth_max_tokens, args.ninth_every, MODES[mode])
                rounds[mode].append(r)
                extra = (f"; the 9th: {r['ninth_requests']} answers, median {r['ninth_median_s']:.2f} s each"
                         if r["ninth_requests"] else "")
                print(f"round {rep + 1}, {mode:>22}: {r['tok_s']:6.1f} tok/s ({r['tokens']} tokens in "
                      f"{r['wall_s']:.1f} s){extra}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    tok_s = {mode: statistics.median(r["tok_s"] for r in rs) for mode, rs in rounds.items()}
    print(f"\n{args.clients} plain clients, median tok/s over {args.reps} rounds:")
    for mode, value in tok_s.items():
        ratio = value / tok_s["alone"]
        flag = "" if mode == "alone" else f"  {ratio:.2f}x alone's" + (
            "" if ratio >= args.min_ratio or mode != "beside, new schemas" else f" (BELOW {args.min_ratio:g}x)")
        print(f"{mode:>22}: {value:6.1f}{flag}")
    cached, new = tok_s["beside, cached schemas"], tok_s["beside, new schemas"]
    print(f"what the compiles cost, beyond the 9th client's own requests: {new / cached:.2f}x (new against cached)")
    return {"rounds": rounds, "tok_s": tok_s, "ratio": tok_s["beside, new schemas"] / tok_s["alone"],
            "compile_ratio": new / cached}


# ---------------------------------------------------------------- (c) a decode step beside compiles, GIL shared or not


def gil_benchmark(args) -> dict:
    """The engine's work (a decode step of 8 rows of SmolLM2, eager) timed alone and while another thread compiles
    new enums back to back: at a lower priority or not, its Deadline letting go of the GIL every GIL_SHARE_S, or
    never."""
    import torch

    import hardway.decode.regex_parser as parser_module
    from hardway.decode.constrained import compile_json_schema, token_vocabulary
    from hardway.formats.hub import checkpoint
    from hardway.loading import load
    from hardway.server.tools import lower_priority
    from hardway.text.tokenizer import load_tokenizer
    folder = checkpoint(SMOLLM2)
    model, tokenizer = load(folder), load_tokenizer(folder)
    token_vocabulary(tokenizer)
    gc.collect()
    gc.freeze()  # as `hardway serve` does
    enum = schemas()["enum of 5,000 strings"]
    ids = torch.randint(0, 1000, (8, 1))  # (B, 1)

    def step_ms() -> float:
        cache, times = model.new_kv_cache(8, args.steps + 1), []
        with torch.inference_mode():
            for position in range(args.steps):
                start = time.perf_counter()
                model(ids, kv_cache=cache, start_pos=position)
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    step_ms()  # warm-up
    shared = parser_module.GIL_SHARE_S
    result = {}
    print(f"a decode step of 8 rows, median of {args.steps}; load average {os.getloadavg()[0]:.2f} at the start")
    cases = (("alone", None, False), ("as the server compiles", shared, True),
             ("the GIL shared, the engine's priority", shared, False),
             ("the GIL kept, the engine's priority", float("inf"), False), ("alone again", None, False))
    for label, every, lowered in cases:
        stop, compiles = threading.Event(), []
        thread = None
        if every is not None:
            parser_module.GIL_SHARE_S = every

            def compiler():
                if lowered:
                    lower_priority()
                while not stop.is_set():
                    compile_json_schema({**enum, "title": f"compile {time.perf_counter()}"}, tokenizer, [2])
                    compiles.append(1)

            thread = threading.Thread(target=compiler)
            thread.start()
            time.sleep(0.3)
        ms = step_ms()
        stop.set()
        if thread is not None:
            thread.join()
        result[label] = ms
        print(f"{label:>37}: {ms:7.1f} ms" + (f" ({len(compiles)} enums compiled meanwhile)" if compiles else ""),
              flush=True)
    parser_module.GIL_SHARE_S = shared
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="(b): 8 plain clients' tok/s, alone and beside a 9th "
                                                             "sending new schemas (default: (a), the compile table)")
    parser.add_argument("--gil", action="store_true", help="(c): a decode step alone and beside back-to-back "
                                                           "compiles, the GIL shared or kept")
    parser.add_argument("--steps", type=int, default=20, help="(c) decode steps timed per case")
    parser.add_argument("--repeats", type=int, default=3, help="(a) processes per schema and implementation")
    parser.add_argument("--walks", type=int, default=20, help="(a) random generations per schema after ours "
                                                              "compiled (0: none)")
    parser.add_argument("--before", metavar="COMMIT", help="(a) also compile with the `hardway` of this commit")
    parser.add_argument("--clients", type=int, default=8, help="(b) plain clients")
    parser.add_argument("--requests", type=int, default=4, help="(b) requests per client per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="(b) tokens of each plain answer")
    parser.add_argument("--ninth-max-tokens", type=int, default=1, help="(b) tokens of each of the 9th's answers")
    parser.add_argument("--ninth-every", type=float, default=1.0, help="(b) seconds between the starts of the 9th's "
                                                                       "requests (0: back to back)")
    parser.add_argument("--reps", type=int, default=2, help="(b) rounds of each mode, interleaved")
    parser.add_argument("--min-ratio", type=float, default=0.9, help="(b) a ratio below this is flagged")
    parser.add_argument("--json", type=Path, help="append the figures to this file, one JSON object per run")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "SCHEMA"), help=argparse.SUPPRESS)  # one compile
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.walks)))
        return 0
    result = serve_benchmark(args) if args.serve else gil_benchmark(args) if args.gil else compile_table(args)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "serve": args.serve, "gil": args.gil, "result": result},
                               default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
