"""The cost of a token mask: ours (lesson 25) against xgrammar and outlines-core, same schemas, SmolLM2's vocabulary.

    uv run python benchmarks/constrained_masks.py                 # the table for docs/structured-output.md
    uv run python benchmarks/constrained_masks.py --repeats 50 --json masks.json

For each schema, one valid JSON text (json.dumps' separators, which every library's grammar here allows) is tokenized
by SmolLM2's tokenizer, and the token sequence is walked through each library's grammar. At every step the library
computes the mask of allowed tokens for the state it is in, and the step is timed:

- compile: the schema to the grammar object (ours: compile_json_schema, what the server runs: schema -> regex -> NFA,
  the lazy DFA's first states and the masks TokenAutomaton.warm computes; xgrammar: compile_json_schema, which
  precomputes its token masks; outlines-core: regex -> Index, every state's tokens computed);
- ours, cold: the first visit of each state the walk meets, a trie walk (making the lazy DFA's states it needs on
  the way; then cached);
- ours, cached: the same walk again, every mask a cache hit;
- xgrammar: fill_next_token_bitmask (its masks come from the compile's cache plus a check of the uncertain tokens);
- outlines-core: get_allowed_tokens, a list of ids (its Index is all precomputed);
- "+ apply": the mask set into a (1, V) row of logits as well (ours: add the state's cached row of 0 / -inf, as
  ConstrainedLogits does; xgrammar: apply_token_bitmask_inplace on a copy of the row).

Per-token figures are the median and the 99th percentile over every step of --repeats walks. Threads: one
(torch.set_num_threads(1), xgrammar max_threads=1). What is loaded before the walks (the tokenizers, the tries) is
frozen out of Python's garbage collector, as `hardway serve` freezes what it holds before it starts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from importlib.metadata import version

import numpy as np
import outlines_core
import torch
import xgrammar
from outlines_core.json_schema import build_regex_from_schema
from transformers import AutoTokenizer

from hardway.decode.constrained import compile_json_schema, token_vocabulary
from hardway.formats.hub import checkpoint
from hardway.text.tokenizer import load_tokenizer

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
EOS = 2
SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]}}, "required": ["name", "age"]},
        {"name": "Alice Martin", "age": 34, "email": "alice@example.com", "tags": ["admin", "ops"],
         "address": {"city": "Lyon", "zip": "69001"}}),
    "tool call (3 functions)": ({"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}, "required": ["name", "arguments"]},
        {"type": "object", "properties": {"name": {"const": "search"}, "arguments": {
            "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"]}}, "required": ["name", "arguments"]},
        {"type": "object", "properties": {"name": {"const": "send_email"}, "arguments": {
            "type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
            "required": ["to", "body"]}}, "required": ["name", "arguments"]}]},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
    "any JSON object": ({"type": "object"},
                        {"id": 7, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-9", "qty": 1}], "paid": True,
                         "note": None}),
}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def summary(seconds: list[float]) -> str:
    micro = [s * 1e6 for s in seconds]
    return f"{statistics.median(micro):,.1f} / {pct(micro, 99):,.1f}"


def ours(schema, ids, tokenizer, repeats, width):
    t0 = time.perf_counter()
    automaton = compile_json_schema(schema, tokenizer, [EOS])
    compile_s = time.perf_counter() - t0
    states_made = automaton.dfa.n_states
    cold, cached, applied, visited = [], [], [], set(automaton._masks)  # the compile's masks: its first visits
    logits = torch.randn(1, width)  # (1, V)
    for r in range(repeats + 1):
        state = automaton.start
        for token in ids + [EOS]:
            first_visit = state not in visited
            visited.add(state)
            t0 = time.perf_counter()
            automaton.allowed(state)
            t1 = time.perf_counter()
            masked = logits + automaton.bias_for(state, width, "cpu")  # (1, V): what ConstrainedLogits does
            t2 = time.perf_counter()
            assert masked[0, token] == logits[0, token], "the text's own token must be allowed"
            if first_visit:
                cold.append(t1 - t0)
            elif r > 0:
                cached.append(t1 - t0)
            if r > 0:
                applied.append(t2 - t0)
            state = automaton.advance(state, token)
    return compile_s, cold, cached, applied, states_made


def xgrammar_run(schema, ids, compiler, info, repeats, width):
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    fills, applied = [], []
    logits = torch.randn(1, width)  # (1, V)
    for _ in range(repeats + 1):
        matcher.reset()
        for token in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            t1 = time.perf_counter()
            row = logits.clone()
            t2 = time.perf_counter()
            xgrammar.apply_token_bitmask_inplace(row, bitmask)
            t3 = time.perf_counter()
            fills.append(t1 - t0)
            applied.append((t1 - t0) + (t3 - t2))
            if not matcher.accept_token(token):
                raise RuntimeError("xgrammar rejected the text's own token")
        if not matcher.accept_token(EOS):
            raise RuntimeError("xgrammar does not end where the text ends")
    return compile_s, fills, applied


def outlines_run(schema, ids, vocabulary, repeats):
    t0 = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
    compile_s = time.perf_counter() - t0
    lookups = []
    for _ in range(repeats + 1):
        state = index.get_initial_state()
        for token in ids:
            t0 = time.perf_counter()
            index.get_allowed_tokens(state)
            lookups.append(time.perf_counter() - t0)
            state = index.get_next_state(state, token)
    return compile_s, lookups


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="walks of each text after the first (default 20)")
    parser.add_argument("--no-outlines", action="store_true", help="skip outlines-core (its Index takes seconds)")
    parser.add_argument("--json", help="append the figures to this file, one JSON object per run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = checkpoint(SMOLLM2)
    tokenizer = load_tokenizer(folder)
    vocabulary = token_vocabulary(tokenizer)
    width = vocabulary.size
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(folder), vocab_size=width)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    by_bytes = {}
    for token_id, data in enumerate(vocabulary.token_bytes):
        if data is not None:
            by_bytes.setdefault(data, []).append(token_id)
    outlines_vocabulary = outlines_core.Vocabulary(EOS, by_bytes)
    gc.collect()
    gc.freeze()  # as `hardway serve` does: a collection walks only what the walks make
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; vocabulary {width} tokens; "
          f"xgrammar {version('xgrammar')}, outlines-core {version('outlines-core')}; one thread; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    print("per token: median / p99, microseconds; compile: milliseconds\n")
    print("| schema | tokens | ours: compile (DFA states made) | ours: first visit (trie walk) | ours: cached | ours: cached + apply | "
          "xgrammar: compile | xgrammar | xgrammar + apply | outlines-core: compile | outlines-core |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, (schema, instance) in SCHEMAS.items():
        ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        compile_s, cold, cached, applied, n_states = ours(schema, ids, tokenizer, args.repeats, width)
        x_compile, x_fills, x_applied = xgrammar_run(schema, ids, compiler, info, args.repeats, width)
        if args.no_outlines:
            o_compile, o_lookups = float("nan"), [float("nan")]
        else:
            o_compile, o_lookups = outlines_run(schema, ids, outlines_vocabulary, args.repeats)
        print(f"| {name} | {len(ids)} | {compile_s * 1e3:,.0f} ({n_states}) | {summary(cold)} | {summary(cached)} | "
              f"{summary(applied)} | {x_compile * 1e3:,.1f} | {summary(x_fills)} | {summary(x_applied)} | "
              f"{o_compile * 1e3:,.0f} | {summary(o_lookups)} |", flush=True)
        rows.append({"schema": name, "tokens": len(ids), "ours_compile_s": compile_s, "dfa_states": n_states,
                     "ours_cold_us": [c * 1e6 for c in cold], "ours_cached_median_us": statistics.median(cached) * 1e6,
                     "xgrammar_compile_s": x_compile, "xgrammar_median_us": statistics.median(x_fills) * 1e6,
                     "outlines_compile_s": o_compile})
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "rows": rows}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
