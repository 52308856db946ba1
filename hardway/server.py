"""An OpenAI-compatible HTTP server over the continuous-batching engine: FastAPI + uvicorn, as vLLM and SGLang use.

    hardway serve --model HuggingFaceTB/SmolLM2-135M-Instruct    # then point any OpenAI client at
                                                                 # http://127.0.0.1:8000/v1
One thread runs the engine loop; the HTTP handlers (on uvicorn's event loop) hand requests to it through a queue,
and it hands each request's new text back through that request's own asyncio queue.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hardway.chat import ChatTemplate, ChatTemplateError
from hardway.serving import Engine, Event, SamplingParams, Sequence

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt the context holds


class APIError(Exception):
    """An error the client caused, answered as OpenAI answers it: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


@dataclass(eq=False)
class Pending:
    """A request on its way through the engine: what the handler waits on."""
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Event, then None when the engine stops
    seq: Sequence | None = None


class EngineThread:
    """The engine loop in one background thread: the only code that touches the engine, so it needs no locks."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()  # ("add", Pending) or ("abort", Pending), from the handlers
        self.pending: dict[int, Pending] = {}    # seq.id -> its request
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Cancel whatever is in flight (each waiting handler is told) and end the loop."""
        self.stopping.set()
        self.thread.join(timeout=30)

    def submit(self, request: Pending) -> None:
        self.inbox.put(("add", request))

    def cancel(self, request: Pending) -> None:
        self.inbox.put(("abort", request))

    def stats(self) -> dict:
        e = self.engine
        return {"total_blocks": e.blocks.n_blocks, "free_blocks": e.blocks.n_free, "block_size": e.blocks.block_size,
                "running": len(e.running), "waiting": len(e.waiting), "preemptions": e.n_preemptions}

    def _deliver(self, request: Pending, event: Event | None) -> None:
        request.loop.call_soon_threadsafe(request.events.put_nowait, event)

    def _take_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, request = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                request.seq = self.engine.add(request.prompt_ids, request.params)  # checked by the handler first
                self.pending[request.seq.id] = request
            elif request.seq is not None and request.seq.id in self.pending:  # abort: the client went away
                self.engine.abort(request.seq)
                del self.pending[request.seq.id]

    def _run(self) -> None:
        while not self.stopping.is_set():
            self._take_inbox(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            for event in self.engine.step():
                request = self.pending.get(event.seq.id)
                if request is not None:
                    self._deliver(request, event)
                    if event.finished:
                        del self.pending[event.seq.id]
        for request in self.pending.values():  # shutting down: cancel what is left, and say so
            self.engine.abort(request.seq)
            self._deliver(request, None)
        self.pending.clear()


# ---- reading a request ---------------------------------------------------------------------------------------------

def _number(body: dict, name: str, default, low=None, high=None, low_open=False, integer=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if low is not None and (value <= low if low_open else value < low) or high is not None and value > high:
        span = f"{'(' if low_open else '['}{low}, {high}]" if high is not None else f">= {low}"
        raise APIError(400, f"'{name}' must be in {span}, got {value!r}", name)
    return value


def sampling_params(body: dict, n_prompt: int, engine: Engine, eos_ids: list[int] | None,
                    default_max_tokens: int | None) -> SamplingParams:
    """The request's sampling fields, checked against OpenAI's ranges and this engine's room."""
    if _number(body, "n", 1, integer=True) != 1:
        raise APIError(400, "only n=1 is supported: send several requests for several completions", "n")
    capacity = engine.capacity()
    if n_prompt >= capacity:
        raise APIError(400, f"the prompt has {n_prompt} tokens; this server holds at most {capacity} positions per "
                            f"request (context {engine.model.max_seq_len}), prompt and completion together", "messages"
                       if "messages" in body else "prompt", "context_length_exceeded")
    room = capacity - n_prompt
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, default_max_tokens or room, integer=True)
    if max_tokens < 1:
        raise APIError(400, f"'{name}' must be at least 1, got {max_tokens}", name)
    if max_tokens > room:
        raise APIError(400, f"'{name}' is {max_tokens}, but the prompt's {n_prompt} tokens leave room for {room} "
                            f"(this server holds {capacity} positions per request)", name, "context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, low=0, high=2)
    top_p = _number(body, "top_p", 1.0, low=0, high=1, low_open=True)
    seed = _number(body, "seed", None, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), seed=seed,
                          stop=stop, stop_token_ids=eos_ids)


async def read_json(request: Request) -> dict:
    """The body as a JSON object, refusing oversized bodies before reading them."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {MAX_BODY_BYTES}")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes")
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    return value


# ---- the app ---------------------------------------------------------------------------------------------------------

def create_app(engine: Engine, model_name: str, chat: ChatTemplate | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under the model name `model_name`; chat needs the checkpoint's template."""
    worker = EngineThread(engine)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()  # after uvicorn stopped taking requests: cancel whatever is still running

    app = FastAPI(title="hardway", lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    def check_model(body: dict) -> None:
        if not isinstance(body.get("model"), str):
            raise APIError(400, "'model' is required: the name GET /v1/models lists", "model")
        if body["model"] != model_name:
            raise APIError(404, f"the model '{body['model']}' does not exist here; this server has '{model_name}'",
                           "model", "model_not_found")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hardway"}]}

    @app.get("/stats")
    async def stats():
        return worker.stats()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' is required: one string (lists of several prompts are not supported)",
                           "prompt")
        ids = engine.tokenizer.encode(prompt)
        if not ids:
            raise APIError(400, "'prompt' is empty: it needs at least one token", "prompt")
        params = sampling_params(body, len(ids), engine, None, default_max_tokens=16)  # OpenAI's default: 16
        return await respond(request, body, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        check_model(body)
        if chat is None:
            raise APIError(400, f"'{model_name}' has no chat template: use /v1/completions", "messages")
        if "messages" not in body:
            raise APIError(400, "'messages' is required: a list of {role, content}", "messages")
        try:
            ids = chat.encode(body["messages"], add_generation_prompt=True)
        except ChatTemplateError as e:
            raise APIError(400, f"'messages': {e}", "messages") from None
        params = sampling_params(body, len(ids), engine, chat.end_of_turn_ids(), default_max_tokens=None)
        return await respond(request, body, ids, params, chat=True)

    async def respond(request: Request, body: dict, ids: list[int], params: SamplingParams, chat: bool):
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be true or false", "stream")
        options = body.get("stream_options") or {}
        include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        pending = Pending(ids, params, asyncio.get_running_loop())
        worker.submit(pending)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            key, message = ("delta", {"content": text}) if delta else ("message", {"role": "assistant", "content": text})
            return {"index": 0, key: message, "logprobs": None, "finish_reason": finish}

        def usage(seq: Sequence) -> dict:
            n = len(seq.output_ids)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if not stream:
            text = []
            while True:
                try:
                    event = await asyncio.wait_for(pending.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        worker.cancel(pending)
                        return error_response(499, "the client closed the request")
                    continue
                if event is None:
                    return error_response(503, "the server is shutting down; the request was cancelled")
                text.append(event.text)
                if event.finished:
                    return {"id": rid, "object": kind, "created": created, "model": model_name,
                            "choices": [choice("".join(text), event.seq.finish_reason, delta=False)],
                            "usage": usage(event.seq)}

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def sse(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            done = False
            try:
                head = {"id": rid, "object": chunk_kind, "created": created, "model": model_name}
                if chat:  # the first chunk says who speaks, as OpenAI's does
                    first = choice("", None, delta=True)
                    first["delta"]["role"] = "assistant"
                    yield sse({**head, "choices": [first]})
                while True:
                    event = await pending.events.get()
                    if event is None:
                        yield sse({"error": {"message": "the server is shutting down; the request was cancelled",
                                             "type": "server_error", "param": None, "code": None}})
                        done = True
                        return
                    if event.text or event.finished:
                        finish = event.seq.finish_reason if event.finished else None
                        yield sse({**head, "choices": [choice(event.text, finish, delta=True)]})
                    if event.finished:
                        done = True
                        if include_usage:
                            yield sse({**head, "choices": [], "usage": usage(event.seq)})
                        yield "data: [DONE]\n\n"
                        return
            finally:
                if not done:  # the client went away mid-stream: free its blocks now
                    worker.cancel(pending)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve(model_id: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 16, n_blocks: int | None = None,
          block_size: int = 16, device: str = "cpu", dtype=None, log_level: str = "warning") -> None:
    """Load a model and serve it until SIGINT/SIGTERM (uvicorn handles both: it stops taking requests, lets running
    ones finish for a few seconds, then the app cancels the rest)."""
    import torch

    from hardway.hub import checkpoint
    from hardway.loading import load
    from hardway.tokenizer import load_tokenizer

    folder = checkpoint(model_id)
    model = load(folder, device=device, dtype=dtype or torch.float32)
    tokenizer = load_tokenizer(folder)
    try:
        chat = ChatTemplate.from_folder(folder)
    except (ChatTemplateError, OSError):
        chat = None  # a base model: /v1/completions only
    if n_blocks is None:  # room for max_batch sequences of 512 positions (or the context, if shorter)
        n_blocks = max_batch * -(-min(model.max_seq_len, 512) // block_size)
    engine = Engine(model, tokenizer, n_blocks=n_blocks, block_size=block_size, max_batch=max_batch)
    app = create_app(engine, model_id, chat)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
