"""How soon `hardway serve` answers after it starts, and what its decode steps' compile costs the answers meanwhile.

    uv run python benchmarks/serve_start.py                                   # SmolLM2, first start and second start
    uv run python benchmarks/serve_start.py --model PATH.gguf --max-tokens 32
    uv run python benchmarks/serve_start.py --flags="--eager"                 # the same server, nothing compiled

Starts `hardway serve` on a free port and, from the moment the process starts, sends the same greedy completion
(--max-tokens tokens) back to back, one at a time, until its decode steps have compiled (/stats lists none still
compiling) and --after more answers have come. It reports: the seconds until the server listens, until its first
answer, until every size is compiled; the answers' tokens/s while compiling and after; whether every answer is the
same text (a request served across the switch from eager to compiled steps must not change); and the process's
peak resident memory (VmHWM). Each start runs twice, with one cache folder: the first start compiles from nothing (a
fresh $XDG_CACHE_HOME, and no Python bytecode: Python compiles every module it imports, torch's included, and keeps
the bytecode there), the second reads back what inductor and Python kept on disk, as a user's every start after the
first does. --peer starts another server the same way
after them (llama.cpp's llama-server on the same .gguf: it listens while it loads, answering 503, so its first answer
is what counts). --json appends the figures to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve import free_port, hardway_serve  # noqa: E402

PROMPT = "The three most useful things to know about the moon are"


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_start(model: str, flags: list[str], cache_home: str, max_tokens: int, after: int, timeout_s: float,
              peer: str | None = None) -> dict:
    """Start `hardway serve` (or, with `peer`, that shell command, its "{port}" filled in) and time it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Python's bytecode kept in the cache folder too (some environments turn it off: PYTHONDONTWRITEBYTECODE), so the
    # second start reads back every module compiled by the first, torch's included, as a user's every later start does
    env = {**os.environ, "XDG_CACHE_HOME": cache_home, "PYTHONPYCACHEPREFIX": os.path.join(cache_home, "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("HARDWAY_EAGER", None)  # the server as a user starts it
    start = time.perf_counter()
    command = ["bash", "-c", f"exec {peer.format(port=port)}"] if peer else hardway_serve(model, port, flags)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    listening = compiled = None
    answers = []  # (seconds since start at the end, seconds it took, tokens, text, compiling when it was sent)
    try:
        with httpx.Client(timeout=600) as client:
            while time.perf_counter() - start < timeout_s:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with {proc.returncode}")
                try:
                    ok = client.get(f"{url}/v1/models", timeout=2).status_code == 200
                except httpx.TransportError:
                    ok = False
                if not ok:  # not listening yet, or (llama-server) still loading
                    time.sleep(0.1)
                    continue
                now = time.perf_counter() - start
                listening = listening if listening is not None else now
                stats = {} if peer else client.get(f"{url}/stats", timeout=2).json()
                if stats.get("compile_error"):
                    raise SystemExit(f"the decode steps did not compile: {stats['compile_error']}")
                compiling = bool(stats.get("compiling_batch_sizes"))
                if not compiling and compiled is None:
                    compiled = now
                if (compiled is not None and sum(not a[4] for a in answers) >= after) or (answers and after == 0):
                    break
                sent = time.perf_counter()
                response = client.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT,
                                                                       "max_tokens": max_tokens, "temperature": 0})
                done = time.perf_counter()
                if response.status_code != 200:  # llama-server: 503 while its model loads
                    time.sleep(0.1)
                    continue
                body = response.json()
                answers.append((done - start, done - sent, body["usage"]["completion_tokens"],
                                body["choices"][0]["text"], compiling))
        peak = peak_rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if compiled is None and after:
        raise SystemExit(f"the decode steps were still compiling after {timeout_s:g} s")

    def tok_s(rows):
        return statistics.median(n / s for _, s, n, _, _ in rows) if rows else None

    during = [a for a in answers if a[4]]
    return {"listening_s": listening, "first_answer_s": answers[0][0], "compiled_s": compiled or float("nan"),
            "answers_while_compiling": len(during), "tok_s_while_compiling": tok_s(during),
            "tok_s_after": tok_s([a for a in answers if not a[4]]),
            "all_answers_the_same": len({a[3] for a in answers}) == 1, "peak_rss_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--flags", default="", help="more `hardway serve` flags, as one string")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--after", type=int, default=5, help="answers to wait for once everything is compiled (0: stop "
                        "at the first answer, compiled or not)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a start may take, compile included")
    parser.add_argument("--peer", action="append", default=[], metavar="LABEL=COMMAND",
                        help="also start another server the same way: a shell command with {port} where its port "
                             "goes, e.g. 'llama-server=/path/llama-server -m FILE.gguf --port {port} -t 2'")
    parser.add_argument("--json", type=Path, help="append the figures to this file")
    args = parser.parse_args()
    print(f"hardway serve --model {args.model} {args.flags}; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    results = {}
    starts = [("first start", None), ("second start", None)] + [tuple(p.split("=", 1)) for p in args.peer]
    with tempfile.TemporaryDirectory() as cache_home:
        for name, peer in starts:
            r = results[name] = one_start(args.model, args.flags.split(), cache_home, args.max_tokens, args.after,
                                          args.timeout, peer)
            during = ("" if r["tok_s_while_compiling"] is None else f", {r['answers_while_compiling']} answers "
                      f"while compiling at {r['tok_s_while_compiling']:.1f} tok/s")
            after = "" if r["tok_s_after"] is None else f", {r['tok_s_after']:.1f} tok/s after"
            compiled = "" if r["compiled_s"] != r["compiled_s"] else f", compiled after {r['compiled_s']:.1f} s"
            print(f"{name}: listening after {r['listening_s']:.1f} s, first answer after {r['first_answer_s']:.1f} s"
                  f"{compiled}{during}{after}; every answer the same text: {r['all_answers_the_same']}; peak "
                  f"resident memory {r['peak_rss_mb']:.0f} MB", flush=True)
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps({"time": time.time(), "model": args.model, "flags": args.flags, "result": results})
                    + "\n")


if __name__ == "__main__":
    main()
