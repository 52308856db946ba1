"""Record what a server answers to `hardway verify --server`, and replay it: with the answers kept in
tests/data/server_answers/, the tests read each server's shapes without that server at hand.

    uv run python tools/server_answers.py URL MODEL NAME --about "llama.cpp's llama-server, ..." [--native]

runs a small ritual against the server at URL (two prompts, 6 new tokens, 2 alternatives beside each, 96 tokens of
perplexity text, the SmolLM2 stand-in as the reference) and writes every request it sent, with the server's status
and answer, to tests/data/server_answers/NAME.json. --native also records llama.cpp's own /completion answers for
the same prompts (the shape its /v1/completions answered in before 2025).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ROOT / "tests" / "data" / "server_answers"
# what `hardway verify --server URL --prompts (these two) --new-tokens 6 --top-logprobs 2 --max-eval-tokens 96` asks
SMALL = dict(prompts=["The capital of France is", "def fibonacci(n):"], new_tokens=6, top_k=2, max_eval_tokens=96)


def key(method: str, path: str, body) -> str:
    return f"{method} {path} {json.dumps(body, sort_keys=True)}"


def body_of(request: httpx.Request):
    return json.loads(request.content) if request.content else None


class Recording(httpx.BaseTransport):
    """Passes every request on to the server, and keeps it with the answer."""

    def __init__(self):
        self.inner, self.exchanges = httpx.HTTPTransport(), []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        content = response.read()
        try:
            answer = json.loads(content)
        except ValueError:
            answer = content.decode(errors="replace")
        self.exchanges.append({"method": request.method, "path": request.url.path, "request": body_of(request),
                               "status": response.status_code, "answer": answer})
        return httpx.Response(response.status_code, headers=response.headers, content=content, request=request)


class Replay(httpx.BaseTransport):
    """Answers each request as the recorded server did; a request it never saw gets a 500 saying so, which the
    ritual reports as it would any server error."""

    def __init__(self, exchanges: list[dict]):
        self.answers = {key(e["method"], e["path"], e["request"]): e for e in exchanges}
        self.asked: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        k = key(request.method, request.url.path, body_of(request))
        self.asked.append(k)
        e = self.answers.get(k)
        if e is None:
            return httpx.Response(500, json={"error": {"message": f"not recorded: {k[:300]}"}}, request=request)
        if isinstance(e["answer"], str):
            return httpx.Response(e["status"], text=e["answer"], request=request)
        return httpx.Response(e["status"], json=e["answer"], request=request)


def load(name: str) -> dict:
    return json.loads((ANSWERS / f"{name}.json").read_text(encoding="utf-8"))


def write(name: str, record: dict) -> None:
    """One exchange a line: small, and a changed answer shows as one changed line."""
    head = {k: v for k, v in record.items() if k != "exchanges"}
    lines = ",\n".join(json.dumps(e, ensure_ascii=False) for e in record["exchanges"])
    (ANSWERS / f"{name}.json").write_text(json.dumps(head, ensure_ascii=False)[:-1] + ', "exchanges": [\n' + lines
                                          + "\n]}\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("model", help="the name the server serves it under")
    parser.add_argument("name", help="the file's name in tests/data/server_answers/, without .json")
    parser.add_argument("--about", required=True, help="which server, version and command line")
    parser.add_argument("--reference", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--native", action="store_true", help="also llama.cpp's own /completion answers")
    args = parser.parse_args(argv)

    from hardway.verify.ritual import format_report
    from hardway.verify.server import Reference, Server, run_server_ritual

    server, recording = Server(args.url, args.model), Recording()
    server.http = httpx.Client(transport=recording, timeout=300)
    checks = run_server_ritual(server, Reference(args.reference), **SMALL)
    if args.native:
        for prompt in SMALL["prompts"]:
            server.send(server.url.removesuffix("/v1") + "/completion",
                        {"prompt": prompt, "n_predict": SMALL["new_tokens"], "n_probs": SMALL["top_k"],
                         "temperature": 0, "return_tokens": True})
    ANSWERS.mkdir(parents=True, exist_ok=True)
    write(args.name, {"about": args.about, "model": args.model, "settings": SMALL, "exchanges": recording.exchanges})
    print(format_report(checks))
    print(f"{len(recording.exchanges)} exchanges written to {ANSWERS / args.name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
