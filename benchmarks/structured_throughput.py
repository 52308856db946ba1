"""Throughput of 8 concurrent chat clients asking for JSON: plain, then with `response_format`, through `hardway serve`.

    uv run python benchmarks/structured_throughput.py                       # starts `hardway serve` on SmolLM2
    uv run python benchmarks/structured_throughput.py --url http://127.0.0.1:8000 --model NAME   # a running server
    uv run python benchmarks/structured_throughput.py --modes plain --requests 2 --max-tokens 16  # a quick look

Every client sends the same kind of chat request (describe a city as JSON with given keys), greedy, one after the
other, --requests each; all --clients start at the same moment. The same prompts are sent in each mode:
`plain` (no response_format: the model is only asked for JSON), `json_object` (`{"type": "json_object"}`) and
`json_schema` (a schema with the keys and their types). Modes run interleaved, --reps rounds, each round with prompts
of its own (no prefix cache reuse across rounds: the server is started with lesson 14's engine). Per mode it reports
requests/s and output tokens/s (completion tokens of every answer over the wall time), the time to first token
(TTFT) and inter-token latency (ITL) medians read from the server's GET /metrics (vLLM's histograms: the difference
of the buckets before and after each round, a median interpolated inside its bucket, as Prometheus's
histogram_quantile does), and how many answers parse as JSON (with the schema's keys, for json_schema). Then each
structured mode's throughput as a ratio of the plain one's.

A server that refuses `response_format` (400) is reported as such for that mode, and the other modes still run.
--json appends the figures to a file, one JSON object per run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from hardway.server.metrics import bucket_quantile, parse_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import free_port, start_hardway  # noqa: E402

CITIES = ("Paris Lima Oslo Cairo Tokyo Quito Rome Dakar Hanoi Bern Delhi Perth Riga Sofia Tunis Accra Baku Doha "
          "Kyiv Lagos Minsk Nairobi Seoul Tbilisi Vienna Warsaw Zagreb Athens Bogota Dublin Havana Lisbon").split()
KEYS = {"name": "string", "country": "string", "population": "integer", "famous_for": "string"}
SCHEMA = {"type": "object", "properties": {k: {"type": t} for k, t in KEYS.items()}, "required": list(KEYS),
          "additionalProperties": False}
RESPONSE_FORMATS = {
    "plain": None,
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
}
_serial = itertools.count()


def city_messages() -> list[dict]:
    """A chat asking for one city as JSON; each call a different city and number, so no two share a prompt."""
    i = next(_serial)
    city = CITIES[i % len(CITIES)]
    return [{"role": "system", "content": f"You answer with one JSON object and nothing else. (Request {i}.)"},
            {"role": "user", "content": f"Describe the city of {city} as a JSON object with the keys "
                                        f"{', '.join(KEYS)}."}]


class Refused(Exception):
    """The server answered a request with an error status: the mode cannot be measured."""


def ask(url: str, model: str, messages: list[dict], mode: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if RESPONSE_FORMATS[mode] is not None:
        body["response_format"] = RESPONSE_FORMATS[mode]
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:300]
        raise Refused(f"{r.status_code}: {message}")
    return r.json()


def valid(answer: dict, mode: str) -> bool:
    """Whether the answer's text is one JSON object (with exactly the schema's keys, for json_schema)."""
    try:
        value = json.loads(answer["choices"][0]["message"]["content"])
    except ValueError:
        return False
    return isinstance(value, dict) and (mode != "json_schema" or set(value) == set(KEYS))


def scrape(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    return parse_metrics(r.text)


def histogram_delta(after: dict, before: dict, name: str) -> dict[str, float]:
    """The histogram's samples as they grew between two scrapes: the observations made in between."""
    keys = [k for k in after if k.startswith(name + "_")]
    return {k: after[k] - before.get(k, 0.0) for k in keys}


def run_round(url: str, model: str, mode: str, clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads at once, each sending `requests` chats one after the other -> this round's figures."""
    prompts = [[city_messages() for _ in range(requests)] for _ in range(clients)]
    answers, errors = [], []

    def client(mine):
        for messages in mine:
            try:
                answers.append(ask(url, model, messages, mode, max_tokens))
            except Refused as e:
                errors.append(str(e))
                return

    before = scrape(url)
    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise Refused(errors[0])
    after = scrape(url)
    latency = {}
    for key, name in (("ttft", "vllm:time_to_first_token_seconds"), ("itl", "vllm:inter_token_latency_seconds")):
        grown = histogram_delta(after, before, name)
        latency[key] = bucket_quantile(grown, name, 0.5)
        latency[key + "_count"] = grown[name + "_count"]
        latency[key + "_mean"] = grown[name + "_sum"] / max(grown[name + "_count"], 1)
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return {"wall_s": wall, "requests": len(answers), "tokens": tokens, "valid": sum(valid(a, mode) for a in answers),
            **latency}


def summarize(rounds: list[dict]) -> dict:
    """Rounds of one mode -> requests/s and tokens/s (median over rounds), latency medians (median over rounds)."""
    return {"req_s": statistics.median(r["requests"] / r["wall_s"] for r in rounds),
            "tok_s": statistics.median(r["tokens"] / r["wall_s"] for r in rounds),
            "ttft_p50_ms": statistics.median(r["ttft"] for r in rounds) * 1e3,
            "itl_p50_ms": statistics.median(r["itl"] for r in rounds) * 1e3,
            "ttft_mean_ms": statistics.median(r["ttft_mean"] for r in rounds) * 1e3,
            "itl_mean_ms": statistics.median(r["itl_mean"] for r in rounds) * 1e3,
            "tokens_per_answer": sum(r["tokens"] for r in rounds) / sum(r["requests"] for r in rounds),
            "valid_json": f"{sum(r['valid'] for r in rounds)}/{sum(r['requests'] for r in rounds)}",
            "rounds": len(rounds)}


def measure(url: str, model: str, args) -> dict:
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in RESPONSE_FORMATS]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; the modes are {', '.join(RESPONSE_FORMATS)}")
    refused: dict[str, str] = {}
    for mode in modes:  # warm-up, and the server's answer to each mode's response_format
        try:
            ask(url, model, city_messages(), mode, 4)
        except Refused as e:
            refused[mode] = str(e)
    rounds: dict[str, list] = {m: [] for m in modes if m not in refused}
    for _ in range(args.reps):  # interleaved: a shared machine's speed drifts, and each mode gets its share of it
        for mode in rounds:
            rounds[mode].append(run_round(url, model, mode, args.clients, args.requests, args.max_tokens))
    return {"model": model, "clients": args.clients, "requests_per_client": args.requests,
            "max_tokens": args.max_tokens, "reps": args.reps,
            "modes": {m: summarize(r) for m, r in rounds.items()}, "refused": refused}


def report(result: dict, min_ratio: float) -> None:
    print(f"{result['model']}: {result['clients']} clients x {result['requests_per_client']} chat requests, "
          f"max_tokens {result['max_tokens']}, greedy, {result['reps']} rounds (medians over rounds)")
    print(f"{'mode':>12} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} {'tok/answer':>10} {'JSON':>7}")
    for mode, r in result["modes"].items():
        print(f"{mode:>12} {r['req_s']:>7.2f} {r['tok_s']:>7.1f} {r['ttft_p50_ms']:>7.0f}ms {r['itl_p50_ms']:>6.0f}ms "
              f"{r['tokens_per_answer']:>10.1f} {r['valid_json']:>7}")
    print("(TTFT and ITL: the server's own histograms, from GET /metrics; a median is read inside vLLM's buckets)")
    for mode, why in result["refused"].items():
        print(f"{mode:>12}: not measured: the server refused response_format ({why})")
    plain = result["modes"].get("plain")
    for mode, r in result["modes"].items():
        if mode == "plain" or plain is None:
            continue
        ratio = r["tok_s"] / plain["tok_s"]
        verdict = "ok" if ratio >= min_ratio else f"BELOW {min_ratio:g}x"
        print(f"{mode} against plain: {ratio:.2f}x the output tok/s, {r['req_s'] / plain['req_s']:.2f}x the "
              f"requests/s ({verdict})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="the model name the server answers to (for hardway: the checkpoint to serve)")
    p.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (without /v1); without it, "
                                 "`hardway serve` is started")
    p.add_argument("--modes", default="plain,json_object,json_schema", help="comma-separated: plain, json_object, "
                                                                            "json_schema")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="chat requests per client per round, one after the other")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--min-ratio", type=float, default=0.9,
                   help="a structured mode's output tok/s below this fraction of plain's is flagged")
    p.add_argument("--max-batch", type=int, default=16, help="hardway only")
    p.add_argument("--json", type=Path, help="append the results to this file")
    args = p.parse_args()
    if args.url:
        result = measure(args.url.rstrip("/"), args.model, args)
    else:
        port = free_port()
        proc = start_hardway(args.model, port, ["--max-batch", str(args.max_batch), "--no-prefix-cache"])
        try:
            result = measure(f"http://127.0.0.1:{port}", args.model, args)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    report(result, args.min_ratio)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
