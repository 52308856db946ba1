"""Serving throughput and latency against the number of concurrent clients, through any OpenAI-compatible server.

    uv run python benchmarks/serve.py --model HuggingFaceTB/SmolLM2-135M-Instruct          # starts `hardway serve`
    uv run python benchmarks/serve.py --url http://127.0.0.1:8101/v1 --model NAME --label vllm  # a running server
    uv run python benchmarks/serve.py --compile 1 --baseline --peer vllm=http://127.0.0.1:8101/v1  # both, one table

Without --url it starts `hardway serve` itself on a free port of 127.0.0.1 (--max-step-tokens is its per-step
token budget: a large one turns chunked prefill off). --baseline also times `hardway.generate` alone on a prompt of
the same kind in this process, once in every round while the server is idle, for the one-client ratio. The load is
the same whatever the server: at each level, c clients each stream one greedy completion of --max-tokens tokens at
the same moment, every prompt distinct (from each other and from every earlier round, so a prefix cache cannot
help). Levels run interleaved, --reps rounds. It reports, per level, the aggregate completion throughput
(completion tokens of all clients over the wall time, prefills included), the time to first token (TTFT) p50 and
the inter-token latency (ITL) p50. Then the long-prompt test: one stream is running when a 1,500-token prompt
arrives; its worst gap between two tokens while the long prompt is admitted. --peer runs the same load against
other running servers in the same rounds (in each round every server gets every level in turn, one server at a time:
a shared machine's speed drifts over minutes, and this way the drift weighs on each alike), and prints the first
one's figures as ratios of theirs.
--json appends the figures to a file, one JSON object per server.
"""

from __future__ import annotations

import argparse
import itertools
import json
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

NAMES = ("Ada Bo Cy Dee Eli Fay Gus Hal Ivo Jan Kai Lee Max Ned Ola Pia Quin Rex Sia Tom Uma Vic Wes Xia Yul Zed "
         "Abe Bea Cal Dov Eve Fin").split()
_prompt_serial = itertools.count()


def story_prompt() -> str:
    """A distinct prompt each call: its first words differ, so no two requests share a cached prefix block."""
    i = next(_prompt_serial)
    return (f"Story {i}. {NAMES[i % len(NAMES)]} the dragon, number {i * 37 % 1000}, learns to cook. Write a long "
            f"story about it. Once upon a time,")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hardway_serve(model: str, port: int, flags: list[str]) -> list[str]:
    """The command line of `hardway serve --model MODEL --port PORT FLAGS...` in this interpreter."""
    return [sys.executable, "-c", "import sys; from hardway.cli import main; sys.exit(main())",
            "serve", "--model", model, "--port", str(port), *flags]


def start_hardway(model: str, port: int, flags: list[str]) -> subprocess.Popen:
    """`hardway serve --model MODEL --port PORT FLAGS...`, once its decode steps have compiled (it answers
    eagerly while they compile: a benchmark measures the server as it runs from then on)."""
    proc = subprocess.Popen(hardway_serve(model, port, flags), stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"hardway serve exited with {proc.returncode}")
        try:
            stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=2).raise_for_status().json()
            if stats.get("compile_error"):
                raise SystemExit(f"hardway serve's decode steps did not compile: {stats['compile_error']}")
            if not stats.get("compiling_batch_sizes"):
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("hardway serve did not start (and compile) within 900 s")


def one_stream(client: OpenAI, model: str, prompt: str, max_tokens: int, out: list, on_token=None) -> None:
    start, stamps, n = time.perf_counter(), [], 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            if on_token is not None:
                on_token(len(stamps))
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    out.append((start, stamps, n))


def run_level(client: OpenAI, model: str, clients: int, max_tokens: int):
    """c clients at once -> (completion tok/s over the wall time, [TTFT], [ITL], tokens received)."""
    results: list = []
    threads = [threading.Thread(target=one_stream, args=(client, model, story_prompt(), max_tokens, results))
               for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if len(results) != clients:
        raise SystemExit(f"{clients} clients: only {len(results)} answers came back")
    tokens = sum(n for _, _, n in results)
    ttft = [s[0] - start0 for start0, s, _ in results if s]
    itl = [b - a for _, s, _ in results for a, b in zip(s, s[1:])]
    return tokens / wall, ttft, itl, tokens


def long_prompt(client: OpenAI, model: str, n_tokens: int) -> str:
    """A prompt of about n_tokens tokens for this server's tokenizer (sized with one probe of its usage count)."""
    words = lambda n: " ".join(f"w{i}" for i in range(n))  # noqa: E731
    probe = client.completions.create(model=model, prompt="Probe: " + words(400), max_tokens=1, temperature=0)
    per_word = probe.usage.prompt_tokens / 400
    return words(int(n_tokens / per_word))


def worst_gap_during_long_prompt(client: OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One stream runs; at its 8th token a long prompt arrives. -> (the stream's worst gap between two tokens from
    then on, in s; the long prompt's token count)."""
    arrived, usage = threading.Event(), {}

    def send_long():
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
        usage["prompt_tokens"] = r.usage.prompt_tokens

    sender = threading.Thread(target=send_long)

    def on_token(i):
        if i == 8:
            arrived.set()
            sender.start()

    out: list = []
    one_stream(client, model, story_prompt(), max_tokens, out, on_token)
    sender.join()
    stamps = out[0][1]
    return max(b - a for a, b in zip(stamps[7:], stamps[8:])), usage["prompt_tokens"]


def load_generate_alone(model_id: str):
    """hardway.generate on one prompt in this process -> a function that times one greedy answer, in tok/s."""
    import torch

    from hardway.decode.generate import generate
    from hardway.formats.hub import checkpoint
    from hardway.loading import load
    from hardway.text.tokenizer import load_tokenizer

    folder = checkpoint(model_id)
    model, tokenizer = load(folder), load_tokenizer(folder)

    def tok_s(max_tokens: int) -> float:
        ids = torch.tensor([tokenizer.encode(story_prompt())])  # (1, T)
        start = time.perf_counter()
        out = generate(model, ids, max_new_tokens=max_tokens)
        return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)

    tok_s(4)  # warm-up
    return tok_s


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(servers: list[tuple[str, str, str]], args, generate_alone=None) -> list[dict]:
    """The whole load against each running server (url, model, label) -> each one's figures (and generate alone's,
    timed in the same rounds). Round by round: in each round every server gets every level in turn, so that a machine
    whose speed drifts over minutes (a shared VM's does, by as much as 1.5x) weighs on every server alike."""
    levels = [int(x) for x in args.levels.split(",")]
    clients = [OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) for url, _, _ in servers]
    for client, (_, model, _) in zip(clients, servers):
        run_level(client, model, 2, 4)  # warm-up
    baseline, short = [], [0] * len(servers)
    tps, ttft, itl = ([{c: [] for c in levels} for _ in servers] for _ in range(3))
    for _ in range(args.reps):
        for k, (client, (_, model, _)) in enumerate(zip(clients, servers)):
            for c in levels:
                t, f, i, n = run_level(client, model, c, args.max_tokens)
                tps[k][c].append(t); ttft[k][c] += f; itl[k][c] += i
                short[k] += c * args.max_tokens - n
        if generate_alone is not None:  # in the same round as the levels: the same load on the machine
            baseline.append(generate_alone(args.max_tokens))
    results = []
    for k, (client, (_, model, label)) in enumerate(zip(clients, servers)):
        text = long_prompt(client, model, args.long_prompt)
        gaps = [worst_gap_during_long_prompt(client, model, f"Attempt {i}: {text}", args.max_tokens)
                for i in range(2)]  # a prompt of its own each time: a prefix cache must not answer the second
        results.append({
            "label": label, "model": model, "max_tokens": args.max_tokens, "reps": args.reps,
            "levels": {c: {"tok_s": statistics.median(tps[k][c]), "ttft_p50_ms": pct(ttft[k][c], .5) * 1e3,
                           "itl_p50_ms": pct(itl[k][c], .5) * 1e3} for c in levels},
            "long_prompt_tokens": gaps[0][1], "worst_gap_ms": max(g for g, _ in gaps) * 1e3, "tokens_short": short[k],
            "generate_alone_tok_s": statistics.median(baseline) if baseline and k == 0 else None})
    return results


def report(result: dict) -> None:
    print(f"{result['label']}: {result['model']}, {result['max_tokens']} new tokens per client, greedy, "
          f"{result['reps']} rounds, medians")
    print(f"{'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>8}")
    for c, r in result["levels"].items():
        print(f"{c:>7} {r['tok_s']:>8.1f} {r['ttft_p50_ms']:>7.0f}ms {r['itl_p50_ms']:>6.0f}ms")
    print(f"a running stream's worst gap while a {result['long_prompt_tokens']}-token prompt is admitted: "
          f"{result['worst_gap_ms']:.0f} ms (the worse of 2 attempts)")
    if result["tokens_short"]:
        print(f"{result['tokens_short']} tokens fewer than asked came back (answers that ended at EOS): tok/s counts "
              f"what came back")
    baseline = result["generate_alone_tok_s"]
    if baseline is not None and 1 in result["levels"]:
        print(f"hardway.generate alone: {baseline:.1f} tok/s; one client through the server: "
              f"{result['levels'][1]['tok_s'] / baseline:.2f}x of it")


def compare(results: list[dict]) -> None:
    """The first server's figures against each other's, as ratios."""
    first = results[0]
    for other in results[1:]:
        ratios = ", ".join(f"{c} clients {r['tok_s'] / other['levels'][c]['tok_s']:.2f}x"
                           for c, r in first["levels"].items())
        ttft = ", ".join(f"{c}: {r['ttft_p50_ms']:.0f} vs {other['levels'][c]['ttft_p50_ms']:.0f} ms"
                         for c, r in first["levels"].items())
        print(f"{first['label']} against {other['label']}: throughput {ratios}; TTFT p50 {ttft}; worst gap "
              f"{first['worst_gap_ms']:.0f} vs {other['worst_gap_ms']:.0f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="the model name the server answers to (for hardway: the checkpoint to serve)")
    p.add_argument("--url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8101/v1; without it, "
                                 "`hardway serve` is started")
    p.add_argument("--label", help="the server's name in the output (default: hardway, or the URL)")
    p.add_argument("--peer", action="append", default=[], metavar="LABEL=URL",
                   help="the same load against this running server too (its first model), in the same rounds as the first "
                        "server; repeatable. Then the first server's figures as ratios of each peer's")
    p.add_argument("--levels", default="1,8,16", help="numbers of concurrent clients, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=16, help="hardway only")
    p.add_argument("--max-step-tokens", type=int, default=512, help="hardway only: tokens per engine step")
    p.add_argument("--compile", metavar="SIZES", help="hardway only: `hardway serve --compile SIZES` (batch sizes "
                                                      "whose decode steps are compiled, e.g. 1)")
    p.add_argument("--eager", action="store_true", help="hardway only: `hardway serve --eager` (nothing compiled; by "
                                                         "default the decode step of one request alone is, on CPU fp32)")
    p.add_argument("--long-prompt", type=int, default=1500, help="tokens of the prompt in the long-prompt test")
    p.add_argument("--baseline", action="store_true",
                   help="also time hardway.generate alone (on the checkpoint --model names) in this process, once per "
                        "round, while the server is idle")
    p.add_argument("--json", type=Path, help="append the results to this file")
    args = p.parse_args()
    if args.max_tokens < 9:  # the long-prompt test sends its prompt at a stream's 8th token and watches the gaps after
        p.error(f"--max-tokens must be at least 9 (the long-prompt test starts at a stream's 8th token), got "
                f"{args.max_tokens}")
    generate_alone = load_generate_alone(args.model) if args.baseline else None
    peers = []
    for peer in args.peer:
        label, _, url = peer.partition("=")
        if not url:
            raise SystemExit(f"--peer takes LABEL=URL, got {peer!r}")
        peers.append((url, OpenAI(base_url=url, api_key="unused", max_retries=0).models.list().data[0].id, label))
    if args.url:
        results = measure([(args.url, args.model, args.label or args.url), *peers], args, generate_alone)
    else:
        port = free_port()
        flags = ["--max-batch", str(args.max_batch), "--max-step-tokens", str(args.max_step_tokens),
                 "--no-prefix-cache"]  # lesson 14's engine
        if args.compile:
            flags += ["--compile", args.compile]
        if args.eager:
            flags += ["--eager"]
        proc = start_hardway(args.model, port, flags)
        label = args.label or (f"hardway (max_step_tokens {args.max_step_tokens}"
                               f"{f', compile {args.compile}' if args.compile else ''}{', eager' if args.eager else ''})")
        try:
            results = measure([(f"http://127.0.0.1:{port}/v1", args.model, label), *peers], args, generate_alone)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    for result in results:
        report(result)
    compare(results)
    if args.json:
        with open(args.json, "a") as f:
            for result in results:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
