"""`hardway serve` end to end: the official `openai` client against a server on 127.0.0.1, started and stopped here.

Greedy output of every request equals `hardway.generate` on that prompt alone (fp32 stand-ins), also when the pool
is too small and requests are preempted; streamed text equals non-streamed; bad input gets OpenAI's error shape;
a client that goes away frees its blocks; 32 concurrent streaming clients all get their answers; SIGTERM stops the
server cleanly.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from hardway.text.chat import ChatTemplate
from hardway.decode.generate import generate
from hardway.formats.hub import checkpoint
from hardway.loading import ModelSource, load
from hardway.text.tokenizer import load_tokenizer

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
GPT2 = "openai-community/gpt2"
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a", "def fib(n):",
           "1, 2, 3, 4,"]
N_NEW = 6    # new tokens per request in most tests
N_LONG = 16  # in the preemption test: 8 requests x (4..13 + 16) positions, more than the pool's 128
HARDWAY = Path(sys.executable).parent / "hardway"  # the console script of this environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`hardway serve` in a subprocess on a free port of 127.0.0.1."""

    def __init__(self, model: str, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen([str(HARDWAY), "serve", "--model", model, "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hardway serve exited with {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError("hardway serve did not answer within 300 s")
        self.client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=10).json()

    def wait_pool_full(self, timeout: float = 60) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            stats = self.stats()
            if stats["free_blocks"] == stats["total_blocks"] and stats["running"] == stats["waiting"] == 0:
                return stats
            time.sleep(0.1)
        raise AssertionError(f"the pool did not fill up again: {self.stats()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def in_threads(fn, args_list):
    """fn(*args) for every args at once, one thread each; the results in order (exceptions re-raised)."""
    results = [None] * len(args_list)

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the test below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def alone(model, ids, n, eos):
    """hardway.generate on one prompt by itself, cut before the first end-of-sequence token."""
    out = generate(model, torch.tensor([ids]), max_new_tokens=n, eos_token_id=eos)[0, len(ids):].tolist()
    return out[:next((i for i, t in enumerate(out) if t in eos), len(out))]


@pytest.fixture(scope="module")
def smollm():
    """A server with a small pool (32 blocks of 4 positions) so that concurrent requests preempt each other."""
    server = Server(SMOLLM2, "--blocks", "32", "--block-size", "4", "--max-batch", "8")
    yield server
    server.stop()


class Reference(dict):
    """prompt -> the text of generate()'s first n tokens on that prompt alone."""

    def __init__(self, tok, ids: dict):
        super().__init__({p: tok.decode(i[:N_NEW]) for p, i in ids.items()})
        self.tok, self.ids = tok, ids

    def text(self, prompt, n):
        return self.tok.decode(self.ids[prompt][:n])


@pytest.fixture(scope="module")
def smollm_reference():
    """What generate() gives for each prompt alone: completions (N_LONG tokens), and a chat answer."""
    folder = checkpoint(SMOLLM2)
    model, tok = load(folder), load_tokenizer(folder)
    chat = ChatTemplate.from_folder(folder)
    completions = Reference(tok, {p: alone(model, tok.encode(p), N_LONG, model.eos_token_ids) for p in PROMPTS})
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_text = tok.decode(alone(model, chat.encode(messages, add_generation_prompt=True), N_NEW,
                                 chat.end_of_turn_ids()))
    return completions, messages, chat_text


def complete(server, prompt, n=N_NEW, **kw):
    r = server.client.completions.create(model=SMOLLM2, prompt=prompt, max_tokens=n, temperature=0, **kw)
    return r.choices[0].text, r


def stream_complete(server, prompt, n=N_NEW):
    """A streaming completion: (text, time to first token, gaps between tokens, completion_tokens)."""
    start = time.perf_counter()
    stamps, parts, usage = [], [], None
    for chunk in server.client.completions.create(model=SMOLLM2, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            parts.append(chunk.choices[0].text)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return "".join(parts), (stamps[0] - start if stamps else None), gaps, usage.completion_tokens


def test_models(smollm):
    assert [m.id for m in smollm.client.models.list().data] == [SMOLLM2]


def test_concurrent_greedy_equals_generate_alone_with_preemption(smollm, smollm_reference):
    """Eight requests at once in a pool of 128 positions with a batch of 8: the pool runs out, the newest is preempted
    and recomputed, and every answer is still token-identical to generate() on its prompt alone."""
    completions, _, _ = smollm_reference
    before = smollm.stats()["preemptions"]
    got = in_threads(lambda p: complete(smollm, p, n=N_LONG)[0], [(p,) for p in PROMPTS * 2])
    assert smollm.stats()["preemptions"] > before, "the pool was meant to run out: nothing was preempted"
    assert got == [completions.text(p, N_LONG) for p in PROMPTS * 2]
    smollm.wait_pool_full()


def test_completion_and_usage(smollm, smollm_reference):
    completions, _, _ = smollm_reference
    text, r = complete(smollm, PROMPTS[0])
    assert text == completions[PROMPTS[0]]
    assert r.object == "text_completion" and r.model == SMOLLM2
    n_prompt = len(load_tokenizer(checkpoint(SMOLLM2)).encode(PROMPTS[0]))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, N_NEW)
    assert r.usage.total_tokens == n_prompt + N_NEW and r.choices[0].finish_reason == "length"


def test_streamed_equals_non_streamed(smollm, smollm_reference):
    completions, messages, chat_text = smollm_reference
    for p in PROMPTS[:2]:
        assert stream_complete(smollm, p)[0] == complete(smollm, p)[0] == completions[p]
    r = smollm.client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=N_NEW, temperature=0)
    assert r.choices[0].message.content == chat_text and r.choices[0].message.role == "assistant"
    chunks = list(smollm.client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=N_NEW,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_string(smollm, smollm_reference):
    completions, _, _ = smollm_reference
    full = completions[PROMPTS[3]]  # " 5, 6, ...": has a comma after the first number
    text, r = complete(smollm, PROMPTS[3], stop=[","])
    assert text == full[:full.index(",")] and r.choices[0].finish_reason == "stop"
    assert stream_complete_stop(smollm, PROMPTS[3]) == text


def stream_complete_stop(server, prompt):
    chunks = server.client.completions.create(model=SMOLLM2, prompt=prompt, max_tokens=N_NEW, temperature=0,
                                              stop=[","], stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_seeded_sampling_is_reproducible(smollm):
    kw = dict(model=SMOLLM2, prompt=PROMPTS[1], max_tokens=N_NEW, temperature=0.9, top_p=0.9)
    a = smollm.client.completions.create(seed=3, **kw).choices[0].text
    b = smollm.client.completions.create(seed=3, **kw).choices[0].text
    assert a == b


BAD = [  # (path, body, status, param, words the message must contain)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "Hi"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "Hi"}, 400, "model", "'model' is required"),
    ("/v1/chat/completions", {"model": SMOLLM2}, 400, "messages", "'messages' is required"),
    ("/v1/chat/completions", {"model": SMOLLM2, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages",
     "robot"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 10_000}, 400, "max_tokens", "room for"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "word " * 200}, 400, "prompt", "the prompt has"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "temperature": -0.5}, 400, "temperature", "[0, 2]"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "n": 0}, 400, "n", "'n' must be in [1, 128]"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "x" * (2 << 20)}, 413, None, "limit"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD, ids=[f"{b[2]}-{b[4][:20]}" for b in BAD])
def test_bad_input_gets_openai_error_json(smollm, path, body, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(smollm.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert words in error["message"] and error["param"] == param
    assert smollm.client.models.list().data  # still serving


def test_more_blocks_than_the_pool_is_refused_not_hung(smollm):
    """The pool holds 128 positions; the context is 8192: a request for 200 new tokens could never run."""
    r = httpx.post(smollm.url + "/v1/completions", json={"model": SMOLLM2, "prompt": "Hi", "max_tokens": 200},
                   timeout=30)
    assert r.status_code == 400 and "128 positions" in r.json()["error"]["message"]


def test_client_disconnect_frees_blocks(smollm):
    """A client that hangs up after one token: the engine drops its sequence (counted as aborted, which a request
    that ran to its end is not, however busy the machine) and every block comes back."""
    aborted = smollm.stats()["aborted"]
    with httpx.stream("POST", smollm.url + "/v1/completions", timeout=120,
                      json={"model": SMOLLM2, "prompt": PROMPTS[1], "max_tokens": 100, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one token in: hang up
    smollm.wait_pool_full(timeout=30)
    assert smollm.stats()["aborted"] == aborted + 1


def test_load_32_streaming_clients(smollm, smollm_reference):
    """32 concurrent streaming clients, mixed prompt lengths and output lengths: every answer arrives, equals the
    reference's start, and the pool is full again afterwards. Prints aggregate tok/s, TTFT and ITL p50/p99."""
    completions, _, _ = smollm_reference
    jobs = [(PROMPTS[i % 4], 2 + i % (N_NEW - 1)) for i in range(32)]  # 2..6 new tokens
    start = time.perf_counter()
    results = in_threads(lambda p, n: stream_complete(smollm, p, n), jobs)
    wall = time.perf_counter() - start
    tokens = 0
    for (p, n), (text, ttft, gaps, n_out) in zip(jobs, results):
        assert text == completions.text(p, n) and n_out == n and ttft is not None
        tokens += n_out
    ttfts = sorted(r[1] for r in results)
    gaps = sorted(g for r in results for g in r[2])

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    print(f"\n32 clients: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s; TTFT p50 {pct(ttfts, .5):.2f} s "
          f"p99 {pct(ttfts, .99):.2f} s; ITL p50 {pct(gaps, .5) * 1e3:.0f} ms p99 {pct(gaps, .99) * 1e3:.0f} ms")
    smollm.wait_pool_full()


def test_sigterm_stops_cleanly_with_a_request_in_flight(smollm):
    """Runs last: SIGTERM while a stream is running; the stream ends (answered or cancelled) and the process exits 0."""
    ended = {}

    def client():
        try:
            ended["text"] = stream_complete(smollm, PROMPTS[1], 100)[0]
        except Exception as e:  # noqa: BLE001 - a cancelled stream may end with a connection error
            ended["error"] = e

    t = threading.Thread(target=client)
    t.start()
    time.sleep(1.0)
    smollm.proc.send_signal(signal.SIGTERM)
    assert smollm.proc.wait(timeout=60) == 0
    t.join(timeout=30)
    assert not t.is_alive() and ended


def test_gpt2_server_greedy_equals_generate_alone():
    folder = checkpoint(GPT2)
    model, tok = load(folder), load_tokenizer(folder)
    expected = [tok.decode(alone(model, tok.encode(p), N_NEW, model.eos_token_ids)) for p in PROMPTS]
    del model
    server = Server(GPT2, "--blocks", "64", "--block-size", "4", "--max-batch", "4")
    try:
        got = in_threads(lambda p: server.client.completions.create(model=GPT2, prompt=p, max_tokens=N_NEW,
                                                                    temperature=0).choices[0].text,
                         [(p,) for p in PROMPTS])
        assert got == expected
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": GPT2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("flags, words", [
    (["--model", "/nonexistent/folder"], "/nonexistent/folder"),
    (["--model", GPT2, "--max-batch", "0"], "--max-batch must be a whole number of at least 1"),
    (["--model", GPT2, "--port", "70000"], "--port must be in 1..65535"),
    (["--model", GPT2, "--max-step-tokens", "0"], "--max-step-tokens must be a whole number of at least 1"),
])
def test_cli_bad_input_is_one_line_and_exit_2(flags, words):
    r = subprocess.run([str(HARDWAY), "serve", *flags], capture_output=True, text=True, timeout=600)
    lines = [l for l in r.stderr.splitlines() if l.startswith("hardway serve: error")]
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_cli_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([str(HARDWAY), "serve", "--model", GPT2, "--port", str(port)], capture_output=True,
                           text=True, timeout=600)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_in_a_thread_of_its_own_returns_and_raises_from_another_thread():
    from hardway.server.launch import in_a_thread_of_its_own
    assert in_a_thread_of_its_own(threading.current_thread) is not threading.main_thread()
    with pytest.raises(OSError, match="no such model"):
        in_a_thread_of_its_own(lambda: (_ for _ in ()).throw(OSError("no such model")))


def test_serve_computes_nothing_in_the_main_thread(monkeypatch):
    """The model loads and the engine is built (its decode steps compiled) outside the main thread, which then never
    runs a parallel loop of its own: else libgomp sees two teams on these cores and the engine thread's workers stop
    spinning between loops (lesson 14, "One thread computes")."""
    import hardway.server.launch as server

    built_in = {}

    class Stop(Exception):
        pass

    real_load = ModelSource.load

    def fake_load(self, *args, **kwargs):
        built_in["load"] = threading.current_thread()
        return real_load(self, *args, **kwargs)

    class RecordingEngine(server.Engine):
        def __init__(self, *args, **kwargs):
            built_in["engine"] = threading.current_thread()
            super().__init__(*args, **kwargs)

    def stop(*args, **kwargs):
        raise Stop  # the engine is built: no need to serve

    monkeypatch.setattr(ModelSource, "load", fake_load)
    monkeypatch.setattr(server, "create_app", stop)
    with pytest.raises(Stop):
        server.serve(GPT2, port=free_port(), engine_class=RecordingEngine)
    assert set(built_in) == {"load", "engine"}
    assert threading.main_thread() not in built_in.values()


def test_each_streamed_chunk_carries_the_tokens_and_logprobs_of_its_own_text(monkeypatch):
    """Eight sampled streams at once, with logprobs and token ids, so the engine's steps interleave with the
    handlers: every chunk's token ids, pushed through one Detokenizer per stream (flushed at the end), spell exactly
    that chunk's text, and its logprobs are those tokens'. The event loop is made slow, as a loaded server's is: it
    sleeps a little after each hand-over from the engine thread, which meanwhile computes more steps. A handler that
    read the engine's live sequence then would send tokens of later steps than its text."""
    import uvicorn

    from hardway.server import worker as server_module
    from hardway.server.app import create_app
    from hardway.engine.engine import Engine
    from hardway.text.detokenizer import Detokenizer

    put_each, step, n_steps = server_module.put_each, Engine.step, [0]

    def counted_step(self):
        n_steps[0] += 1
        return step(self)

    def busy_put_each(items):  # in the event loop's thread
        put_each(items)
        start, deadline = n_steps[0], time.monotonic() + 1
        while n_steps[0] < start + 2 and time.monotonic() < deadline:
            time.sleep(0.005)  # the event loop is busy elsewhere, and the engine thread computes another step

    monkeypatch.setattr(Engine, "step", counted_step)
    monkeypatch.setattr(server_module, "put_each", busy_put_each)

    folder = checkpoint(SMOLLM2)
    model, tok = load(folder), load_tokenizer(folder)
    engine = Engine(model, tok, n_blocks=128, block_size=16, max_batch=8)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, SMOLLM2), host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.config.port}/v1/completions"

    def stream(i):
        body = {"model": SMOLLM2, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 32, "temperature": 1.0,
                "seed": i, "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "stream": True}
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            return [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]

    try:
        streams = in_threads(stream, [(i,) for i in range(8)])
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    n_chunks = 0
    for chunks in streams:
        detok = Detokenizer(tok.decoder)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]
        for chunk in chunks:
            choice = chunk["choices"][0]
            ids = choice["token_ids"]
            spelled = "".join(detok.push(t) for t in ids) + (detok.flush() if choice["finish_reason"] else "")
            assert spelled == choice["text"], (ids, choice)
            assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids], choice
            assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
            n_chunks += 1
    assert n_chunks > 8 * 8  # many chunks: the steps did interleave
