"""The rest of OpenAI's request in `hardway serve`: min_p, presence and frequency penalties, logit_bias,
stop_token_ids, n > 1, response_format and tools, each checked for its effect (against transformers where it has the processor, against a
count by hand where it does not), for its validation (a 400 naming the field), and through the official `openai`
client. An app in this process (the prefix-caching engine on the SmolLM2 stand-in, uvicorn in a thread)."""
import json
import threading
import time
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from openai import BadRequestError, OpenAI
from transformers.generation import logits_process as hf_processors

from hardway.decode.sampling import (LogitBiasLogitsProcessor, MinPLogitsWarper,
                                     PresenceFrequencyPenaltyLogitsProcessor, SamplingConfig, sampling_config)
from hardway.engine.engine import PrefixCachingEngine
from hardway.engine.sequence import SamplingParams
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.server.app import create_app
from hardway.server.tools import hermes_reply
from hardway.text.chat import ChatTemplate
from hardway.text.tokenizer import load_tokenizer
from test_server import SMOLLM2, alone, free_port

PROMPT = "The capital of France is"
BLOCK = 4  # small blocks, so that a short prompt has full blocks to share


@pytest.fixture(scope="module")
def live():
    folder = checkpoint(SMOLLM2)
    model, tok = load(folder), load_tokenizer(folder)
    engine = PrefixCachingEngine(model, tok, n_blocks=96, block_size=BLOCK, max_batch=8)
    app = create_app(engine, SMOLLM2, ChatTemplate.from_folder(folder))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield SimpleNamespace(url=url, engine=engine, model=model, tok=tok, client=client)
    server.should_exit = True
    thread.join(timeout=30)


def post(live, path, body):
    return httpx.post(live.url + path, json=body, timeout=120)


def complete(live, **fields) -> dict:
    body = {"model": SMOLLM2, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    r = post(live, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def stats(live) -> dict:
    return httpx.get(live.url + "/stats", timeout=10).json()


# --- the processors, against transformers or a count by hand -------------------------------------------------------

def test_min_p_equals_transformers():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 1000, generator=g) * 3  # (B, V)
    scores[1, 7] = 30.0  # one very likely token
    scores[2, :3] = scores[2].max() + 1  # a three-way tie at the top
    ids = torch.zeros(4, 1, dtype=torch.long)
    for min_p in (0.0, 0.02, 0.1, 0.5, 1.0):
        assert torch.equal(MinPLogitsWarper(min_p)(ids, scores), hf_processors.MinPLogitsWarper(min_p)(ids, scores.clone()))


def test_logit_bias_equals_transformers_sequence_bias():
    g = torch.Generator().manual_seed(1)
    scores, ids = torch.randn(3, 50, generator=g), torch.randint(0, 50, (3, 9), generator=g)  # (B, V), (B, T)
    bias = {4: 2.5, 9: -100.0, 49: 100}
    theirs = hf_processors.SequenceBiasLogitsProcessor({(t,): float(b) for t, b in bias.items()})(ids, scores.clone())
    assert torch.equal(LogitBiasLogitsProcessor(bias)(ids, scores), theirs)


def test_presence_and_frequency_count_only_generated_tokens():
    scores = torch.zeros(1, 6)  # (1, V)
    ids = torch.tensor([[1, 1, 2, 3, 3, 3, 1]])  # prompt [1, 1, 2], then 3 three times and 1 once
    out = PresenceFrequencyPenaltyLogitsProcessor(0.5, 0.25, prompt_length=3)(ids, scores)
    assert out.tolist() == [[0.0, -(0.5 + 0.25), 0.0, -(0.5 + 0.75), 0.0, 0.0]]  # token 2: in the prompt only


def test_sampling_config_keeps_its_keywords_and_takes_the_new_ones():
    old = SamplingConfig(True, 0.7, 5, 0.9, 1.2)  # positional, as before
    assert (old.do_sample, old.temperature, old.top_k, old.top_p, old.repetition_penalty) == (True, 0.7, 5, 0.9, 1.2)
    assert sampling_config(do_sample=True, temperature=0.8).top_k == 50
    config = SamplingConfig.from_temperature(0, frequency_penalty=0.5, logit_bias={3: 1.0, 1: -2})
    assert config.logit_bias == ((1, -2), (3, 1.0)) and hash(config) and config.needs_processors
    assert not SamplingConfig.from_temperature(0).needs_processors
    assert [type(p).__name__ for p in SamplingConfig(True, min_p=0.1, presence_penalty=1).processors()] == \
        ["PresenceFrequencyPenaltyLogitsProcessor", "MinPLogitsWarper"]
    for bad in (dict(min_p=1.5), dict(presence_penalty=float("nan")), dict(logit_bias={-1: 1.0}),
                dict(logit_bias={3: 101.0}), dict(logit_bias="no")):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


# --- each field's effect through the server ---------------------------------------------------------------------

def test_large_logit_bias_forces_a_token(live):
    token = live.tok.encode(" Paris")[0]
    out = complete(live, logit_bias={str(token): 100}, max_tokens=4)
    assert out["choices"][0]["text"] == live.tok.decode([token] * 4)
    greedy = live.tok.encode(complete(live, max_tokens=1)["choices"][0]["text"])[0]
    banned = complete(live, logit_bias={str(greedy): -100}, max_tokens=1)  # the greedy token banned: another one
    assert live.tok.encode(banned["choices"][0]["text"])[0] != greedy


def greedy_with_penalties(model, ids, n, presence, frequency, eos):
    """Greedy decoding by hand: the logits of the whole sequence, minus OpenAI's penalties counted over the generated
    tokens only (as vLLM counts), argmax."""
    out = []
    for _ in range(n):
        with torch.inference_mode():
            logits = model(torch.tensor([ids + out]))[0, -1].float()  # (V,)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()  # (V,)
        token = int((logits - presence * (counts > 0).float() - frequency * counts).argmax())
        if token in eos:
            break
        out.append(token)
    return out


def test_frequency_and_presence_penalty_equal_a_computation_by_hand(live):
    prompt = "1, 2, 1, 2, 1, 2,"  # greedy repeats itself here: the penalties have something to do
    ids, n = live.tok.encode(prompt), 10
    plain = alone(live.model, ids, n, live.model.eos_token_ids)
    answers = []
    for presence, frequency in ((0.0, 2.0), (2.0, 0.0), (-0.5, 2.0), (2.0, 2.0)):
        expected = greedy_with_penalties(live.model, ids, n, presence, frequency, live.model.eos_token_ids)
        out = complete(live, prompt=prompt, max_tokens=n, presence_penalty=presence, frequency_penalty=frequency,
                       return_token_ids=True)
        assert out["choices"][0]["token_ids"] == expected, (presence, frequency)
        answers.append(expected)
    assert any(a != plain for a in answers)  # the penalties changed the answer, as the computation by hand says


def test_min_p_one_samples_only_the_most_likely_token(live):
    greedy = complete(live, max_tokens=5)["choices"][0]["text"]
    for seed in (1, 2):
        assert complete(live, max_tokens=5, temperature=1.5, min_p=1.0, seed=seed)["choices"][0]["text"] == greedy


def test_stop_token_ids_end_the_answer(live):
    tokens = complete(live, max_tokens=6, return_token_ids=True)["choices"][0]["token_ids"]
    out = complete(live, max_tokens=6, stop_token_ids=[tokens[2]], return_token_ids=True)["choices"][0]
    assert out["token_ids"] == tokens[:2] and out["finish_reason"] == "stop"


def test_rows_with_different_settings_share_a_step_and_each_gets_its_own(live):
    """Several sequences in one engine step (a plain greedy row, a biased one, a penalized one, a sampled one):
    each answer equals that request run alone."""
    engine = PrefixCachingEngine(live.model, live.tok, n_blocks=64, block_size=BLOCK, max_batch=8)
    ids = live.tok.encode("Once upon a time")
    settings = [SamplingParams(max_tokens=6, temperature=0),
                SamplingParams(max_tokens=6, temperature=0, logit_bias={live.tok.encode(" dragon")[0]: 8.0}),
                SamplingParams(max_tokens=6, temperature=0, frequency_penalty=2.0, presence_penalty=0.5),
                SamplingParams(max_tokens=6, temperature=0.9, seed=5, min_p=0.05)]
    rows, sample = [], engine.runner.sample
    engine.runner.sample = lambda seqs, logits: rows.append(len(seqs)) or sample(seqs, logits)  # rows picked per step
    seqs = [engine.add(ids, p) for p in settings]
    while engine.has_work():
        engine.step()
    assert rows and all(r == len(settings) for r in rows)  # every step picked the four rows' tokens together
    for seq, p in zip(seqs, settings):
        (one,) = PrefixCachingEngine(live.model, live.tok, n_blocks=64, block_size=BLOCK).generate([ids], p)
        assert seq.output_ids == one.output_ids
    assert seqs[1].output_ids != seqs[0].output_ids  # the bias changed the greedy answer


# --- n > 1 --------------------------------------------------------------------------------------------------------

def test_n_sampled_choices_differ_and_share_the_prompt_blocks(live):
    ids = live.tok.encode(PROMPT * 3)  # a few full blocks
    before = stats(live)["prefix_cache_hit_tokens"]
    out = complete(live, prompt=ids, n=3, temperature=1.0, seed=11, max_tokens=8)
    hits = stats(live)["prefix_cache_hit_tokens"] - before
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3
    assert hits >= 2 * ((len(ids) - 1) // BLOCK) * BLOCK  # choices 1 and 2 found choice 0's full prompt blocks
    assert out["usage"]["prompt_tokens"] == len(ids)  # counted once
    assert out["usage"]["completion_tokens"] == sum(len(live.tok.encode(c["text"])) for c in choices) or \
        out["usage"]["completion_tokens"] >= 3
    # vLLM's seeds: choice i is seeded seed + i, so it equals a request for one choice with that seed
    for i, c in enumerate(choices):
        assert complete(live, prompt=ids, temperature=1.0, seed=11 + i, max_tokens=8)["choices"][0]["text"] == c["text"]


def test_n_greedy_choices_are_identical_and_usage_counts_them_all(live):
    one = complete(live, max_tokens=5, return_token_ids=True)
    out = complete(live, max_tokens=5, n=4, return_token_ids=True)
    assert [c["text"] for c in out["choices"]] == [one["choices"][0]["text"]] * 4
    assert out["usage"]["completion_tokens"] == 4 * len(one["choices"][0]["token_ids"])
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]


def test_n_streamed_chunks_carry_their_index(live):
    body = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "temperature": 0, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    texts, finishes, roles = {}, {}, set()
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    for chunk in chunks[:-1]:
        (c,) = chunk["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        if c["delta"].get("role"):
            roles.add(c["index"])
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    whole = post(live, "/v1/chat/completions", {**body, "stream": False, "n": 1}).json()
    assert roles == {0, 1} and set(finishes) == {0, 1}
    assert texts[0] == texts[1] == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * whole["usage"]["completion_tokens"]


# --- bad values: a 400 naming the field ---------------------------------------------------------------------------

BAD = [
    ({"n": 0}, "n"), ({"n": 1000}, "n"), ({"n": 1.5}, "n"), ({"n": "2"}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"), ({"presence_penalty": True}, "presence_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"), ({"logit_bias": [5, 1]}, "logit_bias"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids"), ({"stop_token_ids": "2"}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"), ({"best_of": 3}, "best_of"),
    # SamplingParams' own rules: its SamplingParamsError is the 400, the field in `param`
    ({"top_p": 0}, "top_p"), ({"seed": 2**64}, "seed"), ({"stop": [""]}, "stop"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"logit_bias": {"5": 1e300}}, "logit_bias"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{p}={json.dumps(f[p])[:20]}" for f, p in BAD])
def test_bad_values_get_a_400_naming_the_field(live, fields, param):
    r = post(live, "/v1/completions", {"model": SMOLLM2, "prompt": PROMPT, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


# --- the official client ------------------------------------------------------------------------------------------

def test_openai_client_n_penalties_logit_bias(live):
    messages = [{"role": "user", "content": "Say something about cats."}]
    out = live.client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=8, n=3, temperature=0.8,
                                              seed=3, presence_penalty=0.5, frequency_penalty=0.5)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.message.content for c in out.choices)
    token = live.tok.encode(" meow")[0]
    forced = live.client.completions.create(model=SMOLLM2, prompt=PROMPT, max_tokens=3, temperature=0,
                                            logit_bias={str(token): 100})
    assert forced.choices[0].text == live.tok.decode([token] * 3)
    stop = live.client.completions.create(model=SMOLLM2, prompt=PROMPT, max_tokens=3, temperature=0,
                                          extra_body={"min_p": 0.2, "stop_token_ids": [token]})
    assert stop.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(BadRequestError) as e:
        live.client.completions.create(model=SMOLLM2, prompt=PROMPT, max_tokens=2, frequency_penalty=5)
    assert e.value.body["param"] == "frequency_penalty"


# --- response_format and tools ------------------------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "country": {"enum": ["France", "Italy", "Spain"]}},
        "required": ["city", "country"]}
HOTEL = {"type": "object", "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}, "pool": {"type": "boolean"}},
         "required": ["stars", "pool"]}
QUESTION = [{"role": "user", "content": "Name a city in Europe and its country."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "book_hotel", "parameters": HOTEL}}]


def test_openai_client_response_format_json_schema_and_json_object(live):
    out = live.client.chat.completions.create(
        model=SMOLLM2, messages=QUESTION, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), CITY)
    sampled = live.client.completions.create(model=SMOLLM2, prompt="A JSON object about Rome:", max_tokens=40, n=2,
                                             temperature=1.0, seed=7, extra_body={"response_format": {
                                                 "type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}})
    for c in sampled.choices:  # each choice its own grammar state
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), CITY)
    anything = live.client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=30, temperature=0,
                                                   response_format={"type": "json_object"})
    text = anything.choices[0].message.content
    assert text.startswith("{") and (anything.choices[0].finish_reason == "length" or
                                     isinstance(json.loads(text), dict))


def test_openai_client_tool_choice_named_and_required(live):
    named = live.client.chat.completions.create(
        model=SMOLLM2, messages=QUESTION, max_tokens=40, temperature=0, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "book_hotel"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "book_hotel" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), HOTEL)
    required = live.client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=50, temperature=0,
                                                   tools=TOOLS, tool_choice="required")
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "book_hotel")
    jsonschema.validate(json.loads(call.function.arguments), CITY if call.function.name == "get_weather" else HOTEL)
    streamed = live.client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=40, temperature=0,
                                                   tools=TOOLS[:1], tool_choice="required", stream=True)
    calls = [d for chunk in streamed for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), CITY)


def test_tool_choice_auto_needs_a_template_that_writes_tools(live):
    """SmolLM2's template writes no tools: the model could not know them, so "auto" is refused, naming why; "none"
    answers as if there were no tools."""
    with pytest.raises(BadRequestError) as e:
        live.client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=4, tools=TOOLS)
    assert e.value.body["param"] == "tools" and "does not write tools" in e.value.body["message"]
    plain = live.client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=4, temperature=0)
    none = live.client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=4, temperature=0,
                                               tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls


HERMES_TEMPLATE = (  # a short template in the style of Qwen2.5's: the tools in the system turn, calls in <tool_call>
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}\n{%- endfor %}\n</tools>\nReturn a call as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{%- endif %}\n"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_tool_choice_auto_renders_the_tools_and_reads_hermes_calls(live):
    chat = ChatTemplate(HERMES_TEMPLATE, {}, live.tok)
    with_tools = chat.render(QUESTION, True, tools=TOOLS)
    assert '"name": "get_weather"' in with_tools and with_tools != chat.render(QUESTION, True)
    app = create_app(PrefixCachingEngine(live.model, live.tok, n_blocks=96, block_size=BLOCK), SMOLLM2, chat)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"model": SMOLLM2, "messages": QUESTION, "tools": TOOLS,
                                                       "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(live.tok.encode(with_tools, add_special_tokens=False))
    fields, finish = hermes_reply('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                                  '</tool_call><tool_call>{"name": "book_hotel", "arguments": {"stars": 3}}')
    assert finish == "tool_calls" and fields["content"] == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in fields["tool_calls"]] == \
        [("get_weather", {"city": "Rome"}), ("book_hotel", {"stars": 3})]
    assert hermes_reply("no call here") == ({"content": "no call here"}, None)
    assert hermes_reply("<tool_call>{not json</tool_call>") == ({"content": "<tool_call>{not json</tool_call>"}, None)


BAD_STRUCTURED = [
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format",
     "must be a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "patternProperties": {"a": {}}}}}}, "response_format", "patternProperties"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "format": "email"}}}],
      "tool_choice": "required"}, "tools", "'format'"),
    ({"tools": {"f": 1}}, "tools", "must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "letters, digits"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "\"required\""),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "give one of them"),
]


@pytest.mark.parametrize("fields, param, words", BAD_STRUCTURED, ids=[f"{p}-{w[:16]}" for _, p, w in BAD_STRUCTURED])
def test_bad_structured_requests_get_a_400_naming_the_field(live, fields, param, words):
    r = post(live, "/v1/chat/completions", {"model": SMOLLM2, "messages": QUESTION, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert complete(live, max_tokens=1)["choices"][0]["text"]  # still serving


def test_tools_on_completions_are_refused(live):
    r = post(live, "/v1/completions", {"model": SMOLLM2, "prompt": PROMPT, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_held_choices_wait_for_the_first_and_never_outlive_it(live):
    """Choices 1..n-1 wait outside the scheduler until choice 0's prompt is computed; if choice 0 goes away first
    (aborted), they are queued anyway and compute the prompt themselves; every block comes back."""
    engine = PrefixCachingEngine(live.model, live.tok, n_blocks=64, block_size=BLOCK, max_batch=8)
    ids = live.tok.encode(PROMPT * 2)
    params = SamplingParams(max_tokens=3, temperature=0)
    first = engine.add(ids, params)
    others = [engine.add(ids, params, share_prompt_with=first.id) for _ in range(2)]
    assert list(engine.waiting) == [first] and engine.held[first.id] == others
    engine.step()  # choice 0's prompt: the others are queued now
    assert list(engine.waiting) == others and not engine.held
    while engine.has_work():
        engine.step()
    assert engine.scheduler.n_shared_tokens == 2 * ((len(ids) - 1) // BLOCK) * BLOCK
    assert [s.output_ids for s in others] == [first.output_ids] * 2

    first = engine.add(ids, params)
    other = engine.add(ids, params, share_prompt_with=first.id)
    engine.abort(first)
    assert list(engine.waiting) == [other] and not engine.held
    while engine.has_work():
        engine.step()
    assert other.finish_reason == "length"
    assert engine.blocks.n_free == engine.blocks.n_blocks and all(n == 0 for n in engine.blocks.ref_counts)
