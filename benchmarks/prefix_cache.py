"""Prefix caching through the server: 16 requests sharing a ~1,000-token system prompt, with and without the cache.

    uv run python benchmarks/prefix_cache.py                       # `hardway serve`, then `hardway serve --no-prefix-cache`
    uv run python benchmarks/prefix_cache.py --url http://127.0.0.1:8101/v1 --model SmolLM2 --label vllm  # any server

Without --url it starts `hardway serve` twice on free ports of 127.0.0.1, one after the other (prefix cache on, then
--no-prefix-cache), and runs the same load against each: one request sends the system prompt first (the server
has seen it before, as a server that has been up for a minute has), then --clients requests arrive at the same
moment, each the system prompt followed by a question of its own, each streaming --max-tokens greedy tokens. It
reports the prefill tokens the server computed for them (from hardway's /stats: prompt tokens not found in the
cache), the hit rate, and the time to first token (TTFT) p50 and max; a server without /stats gets TTFT only.
Clients and streaming are benchmarks/serve.py's. --json appends the figures to a file, one JSON object per run.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import free_port, one_stream, pct, start_hardway  # noqa: E402

RULES = ["The library opens at nine and closes at six, Monday to Saturday.",
         "Members may borrow up to eight books for three weeks.", "A loan may be renewed twice unless it is reserved.",
         "Late returns cost ten cents a day, up to five dollars a book.", "Children under twelve need a parent's "
         "signature to join.", "The reading room is for quiet work; phones stay silent there.",
         "Printing costs five cents a page in black and white and twenty in colour.", "Wireless access is free; the "
         "password changes every Monday.", "Rooms for groups of up to ten may be booked a week ahead.",
         "Lost cards are replaced for two dollars."]
QUESTIONS = ["Can I renew a book twice?", "When do you open on Saturday?", "How much is colour printing?",
             "Can my son join? He is ten.", "I lost my card. What now?", "Is there wifi?", "Can I book a room for "
             "twelve?", "What does a late book cost?", "May I phone in the reading room?", "How many books at once?",
             "Do you open on Sunday?", "Is printing free?", "Who can join?", "How long is a loan?",
             "Can I reserve a book?", "When does the password change?"]


def system_prompt(n_sections: int) -> str:
    sections = [f"Section {i + 1}, for branch number {i + 1}: " + " ".join(RULES[(i + j) % len(RULES)]
                                                                         for j in range(len(RULES)))
                for i in range(n_sections)]
    return ("You are the help desk of the city's public libraries. These are the rules of every branch.\n"
            + "\n".join(sections) + "\nAnswer the visitor's question in one friendly sentence.\n")


def stats(url: str) -> dict | None:
    try:
        r = httpx.get(url.removesuffix("/v1") + "/stats", timeout=10)
    except httpx.TransportError:
        return None
    return r.json() if r.status_code == 200 else None


def run(url: str, model: str, label: str, system: str, clients: int, max_tokens: int, reps: int) -> dict:
    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1200)
    warm = client.completions.create(model=model, prompt=system + "Hello!", max_tokens=1, temperature=0)
    ttft, computed, admitted = [], 0, 0
    for rep in range(reps):
        before = stats(url)
        results: list = []
        prompts = [f"{system}Visitor {rep * clients + i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(clients)]
        threads = [threading.Thread(target=one_stream, args=(client, model, p, max_tokens, results)) for p in prompts]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(results) != clients:
            raise SystemExit(f"{label}: only {len(results)} of {clients} answers came back")
        ttft += [s[0] - start for _, s, _ in results if s]
        after = stats(url)
        if before is not None and after is not None:
            computed += after["prefix_cache_miss_tokens"] - before["prefix_cache_miss_tokens"]
            admitted += (after["prefix_cache_miss_tokens"] + after["prefix_cache_hit_tokens"]
                         - before["prefix_cache_miss_tokens"] - before["prefix_cache_hit_tokens"])
    return {"label": label, "system_prompt_tokens": warm.usage.prompt_tokens, "clients": clients, "reps": reps,
            "max_tokens": max_tokens, "prefill_tokens_computed": computed if admitted else None,
            "prompt_tokens": admitted or None, "hit_rate": 1 - computed / admitted if admitted else None,
            "ttft_p50_ms": pct(ttft, .5) * 1e3, "ttft_max_ms": max(ttft) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="the model name the server answers to (for hardway: the checkpoint to serve)")
    p.add_argument("--url", help="a running OpenAI-compatible server; without it, `hardway serve` is started twice")
    p.add_argument("--label", help="the server's name in the output (with --url; default: the URL)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--sections", type=int, default=7, help="size of the system prompt (7: about 1,000 tokens)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--reps", type=int, default=1, help="rounds of --clients requests, each with new questions")
    p.add_argument("--json", type=Path, help="append the results to this file")
    args = p.parse_args()
    system = system_prompt(args.sections)
    rows = []
    if args.url:
        rows.append(run(args.url, args.model, args.label or args.url, system, args.clients, args.max_tokens,
                        args.reps))
    else:
        for label, flags in [("hardway serve (prefix cache)", []), ("hardway serve --no-prefix-cache",
                                                                    ["--no-prefix-cache"])]:
            port = free_port()
            proc = start_hardway(args.model, port, flags)
            try:
                rows.append(run(f"http://127.0.0.1:{port}/v1", args.model, label, system, args.clients,
                                args.max_tokens, args.reps))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    print(f"{args.model}: {args.clients} requests at once sharing a {rows[0]['system_prompt_tokens']}-token system "
          f"prompt (seen once before), {args.max_tokens} greedy tokens each, {args.reps} round(s)")
    print(f"{'server':<34} {'prefill computed':>16} {'hit rate':>9} {'TTFT p50':>10} {'TTFT max':>10}")
    for r in rows:
        computed = "-" if r["prefill_tokens_computed"] is None else f"{r['prefill_tokens_computed']}/{r['prompt_tokens']}"
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        print(f"{r['label']:<34} {computed:>16} {hit:>9} {r['ttft_p50_ms']:>8.0f}ms {r['ttft_max_ms']:>8.0f}ms")
    if len(rows) == 2:
        on, off = rows
        cut = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
        print(f"the cache computes {cut:.1%} fewer prefill tokens; TTFT p50 "
              f"{off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x shorter")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
