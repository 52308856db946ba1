"""`hardway serve` while its decode steps compile in the background: hostile requests, signals, and a cancelled compile.

Each server here compiles for real (HARDWAY_EAGER unset, an empty inductor cache of the test's own), and a CPU-heavy
process runs beside it, as on a loaded machine. The checks are outcomes, not speeds: every request is answered as it
should be, /health answers afterwards, a signal ends the process with exit code 0 and no abort. Each test first checks
that the compile is still running, so that it really tests the server while it compiles.
"""
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hardway.engine.engine import Engine
from hardway.engine.model_runner import CompileCancelled, CompileGate
from hardway.engine.sequence import SamplingParams
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer
from test_server import PROMPTS, SMOLLM2, alone
from test_server_faults import ServeProcess

ABORTED = ("terminate called", "Traceback", "core dumped", "leaked")  # what an aborted, crashed or untidy exit prints


@pytest.fixture
def cpu_hog():
    """A process that keeps one core busy for the test's length."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    hog.kill()
    hog.wait()


class CompilingServer(ServeProcess):
    """`hardway serve` on the SmolLM2 stand-in, compiling its default sizes from nothing in the background."""

    def __init__(self, tmp_path, *flags):
        env = {k: v for k, v in os.environ.items() if k != "HARDWAY_EAGER"}  # compile, as a user's server does
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # from nothing: the longest compile
        super().__init__(tmp_path, *flags, env=env)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=30).json()

    def assert_compiling(self):
        assert self.stats()["compiling_batch_sizes"], "the compile ended before the test: it tests nothing"

    def health(self) -> int:
        return httpx.get(self.url + "/health", timeout=30).status_code  # a hung event loop: ReadTimeout, a failure


def completion(server, prompt, max_tokens, **fields):
    return httpx.post(server.url + "/v1/completions", timeout=300,
                      json={"model": SMOLLM2, "prompt": prompt, "max_tokens": max_tokens, **fields})


def stream(server, prompt, max_tokens, chat=False) -> list:
    """A streamed completion (or chat) -> its events, [DONE] last."""
    body = {"model": SMOLLM2, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    events = []
    with httpx.stream("POST", server.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def in_threads(fn, args_list) -> tuple[list[threading.Thread], list]:
    results = [None] * len(args_list)

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    return threads, results


@pytest.fixture(scope="module")
def compiling(tmp_path_factory):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    server = CompilingServer(tmp_path_factory.mktemp("compiling"))
    yield server
    server.close()
    hog.kill()
    hog.wait()


def test_many_stop_strings_are_refused_and_the_server_goes_on(compiling):
    compiling.assert_compiling()
    r = completion(compiling, "Hi", 4, stop=[f"stop {i}" for i in range(1000)])
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert compiling.health() == 200
    assert completion(compiling, PROMPTS[0], 4, temperature=0).status_code == 200


def test_stalled_clients_closed_leave_the_server_answering(compiling):
    compiling.assert_compiling()
    clients = []
    for _ in range(20):  # half a body each, then nothing
        s = socket.create_connection(("127.0.0.1", compiling.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        clients.append(s)
    time.sleep(1)
    for s in clients:
        s.close()
    assert compiling.health() == 200
    assert completion(compiling, PROMPTS[0], 4, temperature=0).status_code == 200


def test_a_prompt_of_one_long_word_is_answered_and_a_stream_beside_it_goes_on(compiling):
    """6,000 letters of one word (about 3,600 tokens, prefilled in chunks) while another client streams."""
    compiling.assert_compiling()
    word = "".join("abcdefghijklmnopqrstuvwxyz"[i * 7919 % 26] for i in range(6000))
    threads, results = in_threads(lambda: stream(compiling, PROMPTS[1], 40), [()])
    long = completion(compiling, word, 4)
    for t in threads:
        t.join(300)
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] > 1000, long.text
    events = results[0]
    assert not isinstance(events, Exception), events
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert compiling.health() == 200
    assert not any(word in compiling.stderr() for word in ABORTED), compiling.stderr()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_compiling_with_requests_finished_and_in_flight_exits_cleanly(tmp_path, cpu_hog, sig):
    """8 requests at once and a streamed chat, all finished; then 4 streams in flight; then the signal, while the
    decode steps compile: exit 0, every stream ends with its last events, no abort. (The abort came from the compile
    thread being torn down inside torch's C++ code as the interpreter shut down: one run in five, here.)"""
    server = CompilingServer(tmp_path, "--grace", "2")
    try:
        threads, results = in_threads(lambda i: completion(server, f"Story {i}:", 8), [(i,) for i in range(8)])
        for t in threads:
            t.join(300)
        assert all(not isinstance(r, Exception) and r.status_code == 200 for r in results), results
        assert stream(server, "Hi", 8, chat=True)[-1] == "[DONE]"
        streams, events = in_threads(lambda i: stream(server, PROMPTS[i], 2000), [(i,) for i in range(4)])
        time.sleep(2)
        server.assert_compiling()
        server.proc.send_signal(sig)
        assert server.proc.wait(timeout=120) == 0, server.stderr()
        for t in streams:
            t.join(60)
        for e in events:  # each stream ended properly: its own end, or the shutdown's error event, then [DONE]
            assert not isinstance(e, Exception) and e[-1] == "[DONE]", e
        assert not any(word in server.stderr() for word in ABORTED), server.stderr()
    finally:
        server.close()


def test_a_signal_right_after_start_exits_cleanly(tmp_path, cpu_hog):
    server = CompilingServer(tmp_path)
    try:
        server.assert_compiling()
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=120) == 0, server.stderr()
        assert not any(word in server.stderr() for word in ABORTED), server.stderr()
    finally:
        server.close()


def test_cancel_ends_a_compile_in_python_at_once_and_the_engine_goes_on(monkeypatch):
    """A backend that would compile forever, in Python: cancel() ends its thread within seconds, no size is ready,
    nothing is reported as an error, the garbage collector's settings are back, and the engine answers eagerly."""
    monkeypatch.setenv("HARDWAY_EAGER", "1")
    folder = checkpoint(SMOLLM2)
    model, tok = load(folder), load_tokenizer(folder)
    entered = threading.Event()

    def compiles_forever(graph_module, example_inputs):
        entered.set()
        while True:
            time.sleep(0.01)

    thresholds = gc.get_threshold()
    engine = Engine(model, tok, n_blocks=32, block_size=16, max_batch=2, compile_sizes=(1,), backend=compiles_forever,
                    background_compile=True)
    decode = engine.runner.decode
    thread = decode.compile_in_background()
    assert entered.wait(300), "dynamo never reached the backend"
    assert decode.cancel(timeout=30) and not thread.is_alive()
    assert decode.ready == set() and decode.error is None
    assert gc.get_threshold() == thresholds
    ids = tok.encode(PROMPTS[0])
    seq = engine.add(ids, SamplingParams(max_tokens=3, temperature=0))
    while engine.has_work():
        engine.step()
    assert seq.output_ids == alone(model, ids, 3, model.eos_token_ids)


def test_the_gate_holds_a_compile_back_while_the_engine_steps():
    """CompileGate on a thread of Python calls standing in for a compile: while the engine's thread is inside a step,
    the compile advances by a few slices at most (one every 0.1 s, a 50th of its idle pace); a cancel ends it."""
    gate = CompileGate()
    progress = [0]

    def tick():
        progress[0] += 1

    def compile_like():
        sys.settrace(gate)
        try:
            while True:
                tick()
        except CompileCancelled:
            pass
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=compile_like)
    thread.start()
    time.sleep(0.5)
    start = progress[0]
    time.sleep(1.0)
    idle = progress[0] - start
    with gate.engine_stepping():
        start = progress[0]
        time.sleep(1.0)
        stepping = progress[0] - start
    gate.cancelled = True
    thread.join(10)
    assert not thread.is_alive(), "the cancel did not end the compile"
    assert idle > 0 and stepping < idle / 4, f"{stepping} calls during a step against {idle} when idle"
