"""Serving throughput and latency against the number of concurrent clients, through `hardway serve` and HTTP.

    uv run python benchmarks/serve.py --model HuggingFaceTB/SmolLM2-135M-Instruct
    uv run python benchmarks/serve.py --model HuggingFaceTB/SmolLM2-135M-Instruct --levels 1,8 --reps 5

Starts `hardway serve` on a free port of 127.0.0.1 and drives it with the official `openai` client: at each level,
c clients each stream one greedy completion of --max-tokens tokens (EOS cannot cut it short: the prompt is chosen so
the answers run to the limit, and the run fails otherwise), all at once. Levels run interleaved, --reps rounds, so a
burst of background load on a shared machine slows every level alike. It prints, per level, the median aggregate
decode throughput (tokens received while every client is decoding, per second), the end-to-end throughput (all
completion tokens / wall time, prefills included), and over all rounds the time to first token (TTFT) and
inter-token latency (ITL), p50 and p99. The last line is the ratio of 8 clients' decode throughput to one client's.
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

HARDWAY = Path(sys.executable).parent / "hardway"
PROMPT = "Write a long story about a dragon who learns to cook. Once upon a time,"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, max_batch: int, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([str(HARDWAY), "serve", "--model", model, "--port", str(port),
                             "--max-batch", str(max_batch)], stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"hardway serve exited with {proc.returncode}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("hardway serve did not start within 600 s")


def one_client(client: OpenAI, model: str, max_tokens: int, out: list) -> None:
    start, stamps, n = time.perf_counter(), [], 0
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    out.append((start, stamps, n))


def run_level(client: OpenAI, model: str, clients: int, max_tokens: int):
    """c clients at once -> (aggregate tok/s end to end, aggregate decode tok/s, [TTFT], [ITL]).

    Decode throughput is counted in the window where every client is decoding: from the moment the last client got
    its first token to the moment the first client got its last one; every token any client receives inside that
    window counts. End to end is all tokens over the wall time, prefills and waiting included."""
    results: list = []
    threads = [threading.Thread(target=one_client, args=(client, model, max_tokens, results)) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if len(results) != clients or any(n != max_tokens for _, _, n in results):
        raise SystemExit(f"{clients} clients: expected {clients} answers of {max_tokens} tokens, got "
                         f"{[n for _, _, n in results]} (an answer ended early: choose another prompt)")
    ttft = [s[0] - start0 for start0, s, _ in results]
    itl = [b - a for _, s, _ in results for a, b in zip(s, s[1:])]
    lo, hi = max(s[0] for _, s, _ in results), min(s[-1] for _, s, _ in results)
    in_window = sum(1 for _, s, _ in results for t in s if lo < t <= hi)
    if hi <= lo or in_window < clients:
        raise SystemExit(f"{clients} clients never all decoded at once: raise --max-tokens or --max-batch")
    return clients * max_tokens / wall, in_window / (hi - lo), ttft, itl


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--levels", default="1,2,4,8,16", help="numbers of concurrent clients, comma-separated")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=16)
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if 1 not in levels or 8 not in levels:
        raise SystemExit("--levels must include 1 and 8: the last line compares them")
    port = free_port()
    proc = start_server(args.model, args.max_batch, port)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        run_level(client, args.model, 2, 4)  # warm-up
        tps = {c: [] for c in levels}
        decode = {c: [] for c in levels}
        ttft = {c: [] for c in levels}
        itl = {c: [] for c in levels}
        for _ in range(args.reps):
            for c in levels:
                t, d, f, i = run_level(client, args.model, c, args.max_tokens)
                tps[c].append(t); decode[c].append(d); ttft[c] += f; itl[c] += i
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(f"{args.model}, {args.max_tokens} new tokens per client, {args.reps} rounds, medians; "
          f"torch threads as the server chose")
    print(f"{'clients':>7} {'decode tok/s':>12} {'end-to-end tok/s':>16} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8}")
    for c in levels:
        print(f"{c:>7} {statistics.median(decode[c]):>12.1f} {statistics.median(tps[c]):>16.1f} "
              f"{pct(ttft[c], .5) * 1e3:>7.0f}ms {pct(ttft[c], .99) * 1e3:>7.0f}ms "
              f"{pct(itl[c], .5) * 1e3:>6.0f}ms {pct(itl[c], .99) * 1e3:>6.0f}ms")
    end_to_end = statistics.median(tps[8]) / statistics.median(tps[1])
    print(f"end to end (prefills and waiting included), 8 clients / 1 client: {end_to_end:.2f}x")
    ratio = statistics.median(decode[8]) / statistics.median(decode[1])
    print(f"aggregate decode throughput, 8 clients / 1 client: {ratio:.2f}x")


if __name__ == "__main__":
    main()
