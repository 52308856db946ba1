"""GET /metrics: Prometheus's text format under vLLM's names, and every count equal to what was sent and received.

An app on a tiny random Llama in this process (test_serving's `tiny_llama`: token ids as prompts, one letter per
token), served by uvicorn in a thread. Each test has its own app, hence its own registry: the counts start at 0.
"""
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hardway.engine.engine import Engine, PrefixCachingEngine
from hardway.engine.sequence import SamplingParams
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.server.app import create_app
from hardway.server.launch import background_server
from hardway.server.metrics import FINISH_REASONS, ServerMetrics
from hardway.text.chat import ChatTemplate
from hardway.text.tokenizer import load_tokenizer
from test_server import SMOLLM2
from test_serving import tiny_llama  # noqa: F401 - the fixture

MODEL = "tiny-llama"
PROMPTS = [[5, 17, 30, 42, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68], [1, 2, 3], [100, 90, 80, 70, 60, 50, 40]]


def scrape(url: str) -> dict:
    """GET /metrics -> {(sample name, frozenset of labels other than model_name/engine): value}, after checking the
    content type and that every sample carries vLLM's two labels."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=") and "charset=utf-8" in r.headers["content-type"]
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.endswith("_created"):
                continue
            assert labels.pop("model_name") == MODEL and labels.pop("engine") == "0", s
            samples[s.name, frozenset(labels.items())] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[name, frozenset(labels.items())]


def complete(url: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def served(tiny_llama):  # noqa: F811
    model, tokenizer = tiny_llama
    app = create_app(Engine(model, tokenizer, n_blocks=32, block_size=4, max_batch=4), MODEL)
    with background_server(app) as url:
        yield url, app


def test_counts_equal_what_was_sent(served):
    url, app = served
    answers = [complete(url, p, n) for p, n in zip(PROMPTS, (6, 3, 9, 1))]
    text = answers[0]["choices"][0]["text"]  # one letter per token: stop at the first letter not seen before it
    k = next(i for i in range(1, len(text)) if text[i] not in text[:i])
    stopped = complete(url, PROMPTS[0], 6, stop=text[k])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["text"] == text[:k]
    answers.append(stopped)
    samples = scrape(url)

    def generated(a):  # tokens the engine picked: an end-of-sequence token that ended an answer is not in its usage
        eos = a["choices"][0]["finish_reason"] == "stop" and a is not stopped
        return a["usage"]["completion_tokens"] + eos

    reasons = [a["choices"][0]["finish_reason"] for a in answers]
    assert value(samples, "vllm:prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert value(samples, "vllm:prompt_tokens_total") == sum(map(len, PROMPTS)) + len(PROMPTS[0])
    assert value(samples, "vllm:generation_tokens_total") == sum(generated(a) for a in answers)
    for reason in FINISH_REASONS:
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == reasons.count(reason), reason
    assert reasons.count("length") >= 1 and reasons.count("stop") >= 1
    n = len(answers)
    assert value(samples, "vllm:time_to_first_token_seconds_count") == n
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == n
    assert value(samples, "vllm:request_queue_time_seconds_count") == n
    assert value(samples, "vllm:inter_token_latency_seconds_count") == sum(generated(a) - 1 for a in answers)
    assert value(samples, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == n
    assert value(samples, "vllm:inter_token_latency_seconds_sum") > 0
    assert value(samples, "vllm:num_requests_running") == value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0  # every block back in the pool
    assert value(samples, "vllm:num_preemptions_total") == 0
    assert value(samples, "vllm:prefix_cache_queries_total") == 0  # vLLM counts them only where prefixes are cached
    edges = sorted(float(dict(labels)["le"]) for name, labels in samples
                   if name == "vllm:inter_token_latency_seconds_bucket")
    assert edges[:3] == [0.01, 0.025, 0.05] and len(edges) == 20  # vLLM's 19 edges, and +Inf


def test_a_cancelled_stream_is_counted_as_abort(served):
    url, app = served
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 50, "temperature": 0, "stream": True}
    received = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += len(json.loads(line[6:])["choices"][0]["text"])
            if received >= 2:
                break  # the client hangs up mid-answer
    deadline = time.monotonic() + 10
    while (samples := scrape(url)) and value(samples, "vllm:request_success_total", finished_reason="abort") == 0:
        assert time.monotonic() < deadline, "the cancelled stream was never counted"
        time.sleep(0.05)
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 0
    assert value(samples, "vllm:num_requests_running") == value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "vllm:prompt_tokens_total") == len(PROMPTS[1])  # it was prefilled
    assert received <= value(samples, "vllm:generation_tokens_total") < 50
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 1


def test_prefix_cache_hits_after_a_repeated_prompt(tiny_llama):  # noqa: F811
    model, tokenizer = tiny_llama
    app = create_app(PrefixCachingEngine(model, tokenizer, n_blocks=32, block_size=4), MODEL)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks of 4, then the last token's block
    with background_server(app) as url:
        first = complete(url, prompt, 4)
        after_one = scrape(url)
        second = complete(url, prompt, 4)
        samples = scrape(url)
        stats = httpx.get(url + "/stats").json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert value(after_one, "vllm:prefix_cache_queries_total") == len(prompt)
    assert value(after_one, "vllm:prefix_cache_hits_total") == 0
    assert value(samples, "vllm:prefix_cache_queries_total") == 2 * len(prompt)
    assert value(samples, "vllm:prefix_cache_hits_total") == 12 == stats["prefix_cache_hit_tokens"]
    assert value(samples, "vllm:kv_cache_usage_perc") == 0  # cached blocks nobody holds count as free, as in vLLM


def test_preemptions_and_two_registries(tiny_llama):  # noqa: F811
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, n_blocks=6, block_size=4, max_batch=4)  # too small for four at once
    metrics, other = ServerMetrics(MODEL), ServerMetrics(MODEL)  # a registry each: no clash of names
    seqs = [engine.add(ids, SamplingParams(max_tokens=6, temperature=0)) for ids in PROMPTS]
    while engine.has_work():
        metrics.record(engine.step()[1])  # each step's StepStats, as the server's EngineThread records it
    samples = {(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))): s.value
               for f in text_string_to_metric_families(metrics.text().decode()) for s in f.samples}
    assert engine.n_preemptions > 0
    assert value(samples, "vllm:num_preemptions_total") == engine.n_preemptions
    assert value(samples, "vllm:generation_tokens_total") == sum(len(s.token_times) for s in seqs)
    assert value(samples, "vllm:iteration_tokens_total_count") > 0
    untouched = {s.name: s.value for f in text_string_to_metric_families(other.text().decode()) for s in f.samples}
    assert untouched["vllm:num_preemptions_total"] == 0 and untouched["vllm:generation_tokens_total"] == 0


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A 1-layer random Llama with SmolLM2's vocabulary, its tokenizer and its chat template: chat requests in
    milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = checkpoint(SMOLLM2)
    tokenizer = load_tokenizer(folder)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(vocab_size=max(tokenizer.decoder) + 1, hidden_size=16,
                                             intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1, max_position_embeddings=256,
                                             tie_word_embeddings=True)).eval()
    saved = tmp_path_factory.mktemp("tiny-chat")
    reference.save_pretrained(saved)
    return load(saved), tokenizer, ChatTemplate.from_folder(folder)


def test_the_structured_benchmark_measures_plain_and_reports_a_refusal(tiny_chat):
    """benchmarks/structured_throughput.py against an in-process server: the plain mode is measured from /metrics,
    and a response_format the server refuses is reported as refused, not a crash."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import structured_throughput as bench

    model, tokenizer, chat = tiny_chat
    app = create_app(Engine(model, tokenizer, n_blocks=64, block_size=16, max_batch=4), MODEL, chat)
    args = SimpleNamespace(modes="plain,json_object", clients=3, requests=2, max_tokens=5, reps=1)
    with background_server(app) as url:
        result = bench.measure(url, MODEL, args)
        samples = scrape(url)
    plain = result["modes"]["plain"]
    assert plain["rounds"] == 1 and plain["req_s"] > 0 and plain["tok_s"] > 0 and plain["itl_p50_ms"] > 0
    assert value(samples, "vllm:request_success_total", finished_reason="length") >= 6  # the round's, and warm-up's
    if "json_object" in result["refused"]:  # a server without response_format (today's): a 400, said so
        assert result["refused"]["json_object"].startswith("400: 'response_format'")
        assert "json_object" not in result["modes"]
    else:  # a server that takes it: measured like plain
        assert result["modes"]["json_object"]["rounds"] == 1
