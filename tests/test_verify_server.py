"""`hardway verify --server` (lesson 19): it passes on `hardway serve` (fp32, both stand-ins), and it catches servers
broken on purpose here, each by the check that should catch it, with a message naming what differs:

- a wrong chat template (an outdated default system message): the chat template check;
- RoPE's base changed (rope_theta 10000 where the checkpoint says 100000): the token logprobs;
- a tokenizer with one special token off by one (<|im_end|> read as id 3, not 2): the chat template check;
- log-probabilities computed from bf16 logits: the token logprobs (its fp32 bar is 1e-4; bf16 rounds 2^-8 of a value).

An unreachable server, and one that offers nothing the ritual can use, are one line and exit 2; a failed check is
the table and exit 1. Everything listens on 127.0.0.1 only.

Other servers' answer shapes are read from their recorded answers (tests/data/server_answers/, recorded with
tools/server_answers.py and replayed here without a network): llama.cpp's llama-server (logprobs as one object per
token with its id; prompt and chat ids from /tokenize and /apply-template; echo ignored), its own pre-2025 shape
(`completion_probabilities`), and transformers serve (no log-probabilities, no ids, extra fields refused with 422).
A recorded answer changed by hand (one token, one log-probability) must fail the check that reads it; a malformed one
is a SKIP with one line, never a traceback.
"""
import copy
import json
import math

import httpx
import pytest
import server_answers  # tools/: the recorded answers, and the transport that replays them
import torch
from fastapi import FastAPI
from test_server import GPT2, SMOLLM2, free_port

from hardway import cli
from hardway.engine import logprobs as serving
from hardway.engine import model_runner
from hardway.text.chat import ChatTemplate
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.engine.engine import PrefixCachingEngine
from hardway.server.app import create_app
from hardway.engine.engine import Engine
from hardway.text.tokenizer import load_tokenizer
from hardway.verify.server import Reference, Server as Endpoint, ServerUnusable, run_server_ritual
from hardway.server.launch import background_server
from hardway.verify.answers import read_completion

CHECKS = ("tokenizer", "greedy tokens", "token logprobs", "perplexity", "chat template")
SMALL = dict(prompts=["The capital of France is", "def fibonacci(n):"], new_tokens=6, max_eval_tokens=96, window=48)


@pytest.fixture(scope="module")
def smollm():
    folder = checkpoint(SMOLLM2)
    return dict(folder=folder, model=load(folder), tokenizer=load_tokenizer(folder),
                chat=ChatTemplate.from_folder(folder), reference=Reference(folder))


def ritual(app, reference, name=SMOLLM2) -> dict:
    with background_server(app) as url:
        checks = run_server_ritual(Endpoint(url, name), reference, **SMALL)
    return {c.name: c for c in checks}


def engine(s, model=None, tokenizer=None):
    return Engine(model or s["model"], tokenizer or s["tokenizer"], n_blocks=64, block_size=16)


def table(capsys) -> dict[str, str]:
    """The report `hardway verify` printed: check name -> its line."""
    lines = capsys.readouterr().out.splitlines()
    return {name: line for line in lines for name in CHECKS if line.startswith(name + " ")} | {"": "\n".join(lines)}


def verify_cli(url, s, *flags) -> int:
    return cli.main(["verify", "--server", url, "--model", SMOLLM2, "--reference", str(s["folder"]), *flags])


def test_hardway_serve_passes_through_the_cli(smollm, capsys, monkeypatch):
    """`hardway serve`'s app and engine (lesson 15's prefix-caching one, its default), and `hardway verify --server`
    against it: every check runs and passes, in fp32."""
    monkeypatch.setattr("hardway.verify.server.Reference", lambda folder, device: smollm["reference"])
    app = create_app(PrefixCachingEngine(smollm["model"], smollm["tokenizer"], n_blocks=64), SMOLLM2, smollm["chat"])
    with background_server(app) as url:
        code = verify_cli(url, smollm, "--new-tokens", "8", "--max-eval-tokens", "128")
    report = table(capsys)
    assert code == 0, report[""]
    for name in CHECKS:
        assert " PASS " in report[name], report[""]
    assert "all checks that could run passed" in report[""]


def test_gpt2_server_passes():
    folder = checkpoint(GPT2)
    model, tokenizer = load(folder), load_tokenizer(folder)
    checks = ritual(create_app(Engine(model, tokenizer, n_blocks=64), GPT2), Reference(folder), GPT2)
    for name in ("tokenizer", "greedy tokens", "token logprobs", "perplexity"):
        assert checks[name].passed and not checks[name].skipped, checks[name]
    assert checks["chat template"].skipped  # GPT-2 has none: nothing to compare


def test_a_wrong_chat_template_fails_the_chat_check_table_and_exit_1(smollm, capsys, monkeypatch):
    old = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert old in smollm["chat"].source
    wrong = ChatTemplate(smollm["chat"].source.replace(old, "You are a helpful assistant"),
                         smollm["chat"].special_tokens, smollm["tokenizer"])
    monkeypatch.setattr("hardway.verify.server.Reference", lambda folder, device: smollm["reference"])
    with background_server(create_app(engine(smollm), SMOLLM2, wrong)) as url:
        code = verify_cli(url, smollm, "--new-tokens", "4", "--max-eval-tokens", "64")
    report = table(capsys)
    assert code == 1 and "FAILED: chat template" in report[""], report[""]
    # "<|im_start|>system\nYou are a helpful" is 7 tokens; then " AI" in the reference's, " assistant" in the server's
    assert " FAIL " in report["chat template"] and "token 7 differs: server ' assistant' (id 11173), reference ' AI'" \
        in report["chat template"], report[""]
    for name in CHECKS[:-1]:
        assert " PASS " in report[name], report[""]


def test_a_changed_rope_base_fails_the_logprobs(smollm, tmp_path):
    for f in smollm["folder"].iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((smollm["folder"] / "config.json").read_text())
    assert config["rope_theta"] == 100000.0
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))
    checks = ritual(create_app(engine(smollm, model=load(tmp_path)), SMOLLM2, smollm["chat"]), smollm["reference"])
    logprobs = checks["token logprobs"]
    assert not logprobs.passed and "max |Δ| = " in logprobs.measured and "server" in logprobs.measured, logprobs
    assert float(logprobs.measured.split("max |Δ| = ")[1].split()[0]) > 1e-2
    assert not checks["perplexity"].passed
    assert checks["tokenizer"].passed  # the same tokens, computed wrongly


def test_a_special_token_off_by_one_fails_the_chat_check(smollm):
    tokenizer = copy.deepcopy(smollm["tokenizer"])
    assert tokenizer.added_tokens["<|im_end|>"] == 2
    tokenizer.added_tokens["<|im_end|>"] = 3
    chat = ChatTemplate(smollm["chat"].source, smollm["chat"].special_tokens, tokenizer)
    checks = ritual(create_app(engine(smollm, tokenizer=tokenizer), SMOLLM2, chat), smollm["reference"])
    assert not checks["chat template"].passed, checks["chat template"]
    assert "server '<repo_name>' (id 3), reference '<|im_end|>' (id 2)" in checks["chat template"].measured
    for name in ("tokenizer", "greedy tokens", "token logprobs", "perplexity"):  # plain text has no special token
        assert checks[name].passed, checks[name]


def test_logprobs_from_bf16_fail_the_logprobs_check(smollm, monkeypatch):
    exact = serving.token_logprobs

    def from_bf16(logits, tokens, k):  # a server that takes the log-softmax of bf16 logits
        return exact(logits.to(torch.bfloat16), tokens, k)

    monkeypatch.setattr(serving, "token_logprobs", from_bf16)  # every new token's
    monkeypatch.setattr(model_runner, "token_logprobs", from_bf16)  # the prompt's (echo), which the runner computes
    checks = ritual(create_app(engine(smollm), SMOLLM2, smollm["chat"]), smollm["reference"])
    logprobs = checks["token logprobs"]
    assert not logprobs.passed and "≤ 0.0001 (float32)" in logprobs.target, logprobs
    assert checks["greedy tokens"].passed and checks["tokenizer"].passed  # the tokens are still right


def test_an_unreachable_server_is_one_line_and_exit_2(capsys):
    code = cli.main(["verify", "--server", f"http://127.0.0.1:{free_port()}", "--model", SMOLLM2,
                     "--reference", "unused"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot reach http://127.0.0.1:" in err[0], err


def test_a_server_that_offers_none_of_it_is_one_line_and_exit_2(smollm, capsys, monkeypatch):
    app = FastAPI()  # lists the model, and answers nothing else

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": SMOLLM2, "object": "model"}]}

    monkeypatch.setattr("hardway.verify.server.Reference", lambda folder, device: smollm["reference"])
    with background_server(app) as url:
        code = verify_cli(url, smollm)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "answers neither /completions (404" in err[0] and \
        "nothing to verify" in err[0], err
    with background_server(app) as url, pytest.raises(ServerUnusable, match="serves .*, not 'gpt-9'"):
        Endpoint(url, "gpt-9").check()


# Other servers, from their recorded answers -------------------------------------------------------------------------

def recorded(name: str, change=None) -> tuple[Endpoint, dict]:
    """An Endpoint whose requests the recorded answers of `name` answer (edited by `change` first), and the record."""
    record = server_answers.load(name)
    if change is not None:
        change(record["exchanges"])
    server = Endpoint("http://127.0.0.1:8000", record["model"])
    server.http = httpx.Client(transport=server_answers.Replay(record["exchanges"]))
    return server, record


def replay(smollm, name: str, change=None) -> dict:
    """The ritual against `name`'s recorded answers: check name -> Check, each a single line, none missing a record."""
    server, record = recorded(name, change)
    checks = run_server_ritual(server, smollm["reference"], **record["settings"])
    for c in checks:
        assert "\n" not in c.measured and "not recorded" not in c.measured, c
    return {c.name: c for c in checks}


def answers(exchanges, path: str = "/v1/completions") -> list[dict]:
    """The recorded 200 answers to `path`, in the order asked."""
    return [e["answer"] for e in exchanges if e["path"] == path and e["status"] == 200]


def test_llama_cpp_recorded_answers(smollm):
    """llama.cpp's llama-server on the same weights in f32: every id it gives is read, and its tokens, tokenizer and
    chat template are the reference's. Its log-probabilities are not within fp32's bar: with flash attention (its
    default) it casts the f32 KV cache to f16 for the attention, ~1e-2 here."""
    checks = replay(smollm, "llama_cpp")
    assert checks["tokenizer"].passed and "2 prompts tokenized identically (ids from its /tokenize)" in \
        checks["tokenizer"].measured, checks["tokenizer"]
    assert checks["greedy tokens"].passed and "12 of 12 tokens identical over 2 prompts (token ids)" in \
        checks["greedy tokens"].measured, checks["greedy tokens"]
    logprobs = checks["token logprobs"]
    assert not logprobs.passed and not logprobs.skipped and "over 36 values" in logprobs.measured, logprobs
    assert 1e-4 < float(logprobs.measured.split("max |Δ| = ")[1].split()[0]) < 0.05, logprobs
    assert checks["perplexity"].skipped and "it ignores echo" in checks["perplexity"].measured, checks["perplexity"]
    chat = checks["chat template"]
    assert chat.passed and not chat.skipped and "37 prompt tokens identical (ids from its /apply-template and " \
        "/tokenize)" in chat.measured, chat


def test_transformers_serve_recorded_answers(smollm):
    """transformers serve refuses vLLM's extra fields (422), gives neither ids nor log-probabilities, and takes no
    prompt as token ids: what can be checked from its text passes, the rest is SKIP saying why."""
    checks = replay(smollm, "transformers_serve")
    assert checks["tokenizer"].skipped and checks["token logprobs"].skipped, checks
    assert "no log-probabilities" in checks["token logprobs"].measured
    assert checks["greedy tokens"].passed and not checks["greedy tokens"].skipped
    assert "12 of 12 tokens identical over 2 prompts (re-tokenized from the text)" in checks["greedy tokens"].measured
    assert checks["perplexity"].skipped and "answered 400: prompt must be a string." in checks["perplexity"].measured
    assert checks["chat template"].passed and "37 prompt tokens (ids not returned)" in checks["chat template"].measured


def test_reading_a_recorded_llama_cpp_answer(smollm):
    record = server_answers.load("llama_cpp")
    answer = answers(record["exchanges"])[1]  # "def fibonacci(n):", asked with echo, which llama.cpp ignores
    got = read_completion(answer, smollm["reference"], None, echo=True, prompt_text="def fibonacci(n):")
    content = answer["choices"][0]["logprobs"]["content"]
    assert got.ids == [c["id"] for c in content] and got.how == "token ids"
    assert got.logprobs == [c["logprob"] for c in content] and got.prompt_logprobs is None and got.prompt_ids is None
    assert got.top[0] == {t["id"]: t["logprob"] for t in content[0]["top_logprobs"]}


def test_a_token_changed_in_a_recorded_answer_fails_greedy(smollm):
    def swap(exchanges):  # "def fibonacci(n):\n    if n": the server's 3rd token ' n' -> its runner-up ' isinstance'
        entry = answers(exchanges)[1]["choices"][0]["logprobs"]["content"][2]
        assert entry["id"] == 304 and entry["top_logprobs"][1]["id"] == 7923
        entry.update({k: entry["top_logprobs"][1][k] for k in ("id", "token", "bytes", "logprob")})

    greedy = replay(smollm, "llama_cpp", swap)["greedy tokens"]
    assert not greedy.passed and "prompt 1 ('def fibonacci(n):'), new token 2: the server picked ' isinstance' " \
        "(id 7923), the reference ' n' (id 304)" in greedy.measured, greedy

    def paris_to_lyon(exchanges):  # no ids: the text is re-tokenized, and read all the same
        for answer in answers(exchanges):
            answer["choices"][0]["text"] = answer["choices"][0]["text"].replace(" Paris", " Lyon")

    greedy = replay(smollm, "transformers_serve", paris_to_lyon)["greedy tokens"]
    assert not greedy.passed and "new token 0: the server picked ' Lyon'" in greedy.measured, greedy


def test_a_logprob_changed_in_a_recorded_answer_is_named(smollm):
    def shift(exchanges):  # prompt 0's 2nd new token ('.'), off by 0.5
        answers(exchanges)[0]["choices"][0]["logprobs"]["content"][1]["logprob"] -= 0.5

    logprobs = replay(smollm, "llama_cpp", shift)["token logprobs"]
    assert not logprobs.passed and "largest at prompt 0 ('The capital of France is'), new token 1, '.' (id 30)" in \
        logprobs.measured and float(logprobs.measured.split("max |Δ| = ")[1].split()[0]) > 0.45, logprobs


def as_llama_cpp_2024(exchanges, probabilities: bool = False):
    """The recorded /v1/completions answers replaced by llama.cpp's own /completion answers for the same prompts,
    the shape its /v1/completions answered in before 2025; `probabilities`: in the still older entries,
    {content, probs: [{tok_str, prob}]}, without ids, converted from the recorded ones."""
    native = {e["request"]["prompt"]: e["answer"] for e in exchanges if e["path"] == "/completion"}
    for e in exchanges:
        if e["path"] == "/v1/completions" and e["status"] == 200 and isinstance(e["request"]["prompt"], str):
            e["answer"] = copy.deepcopy(native[e["request"]["prompt"]])
            if probabilities:
                e["answer"]["tokens"] = []
                e["answer"]["completion_probabilities"] = [
                    {"content": c["token"], "probs": [{"tok_str": t["token"], "prob": math.exp(t["logprob"])}
                                                      for t in c["top_logprobs"]]}
                    for c in e["answer"]["completion_probabilities"]]


def test_llama_cpp_own_answer_shape(smollm):
    checks = replay(smollm, "llama_cpp", as_llama_cpp_2024)
    assert checks["greedy tokens"].passed and "12 of 12 tokens identical over 2 prompts (token ids)" in \
        checks["greedy tokens"].measured, checks["greedy tokens"]
    assert not checks["token logprobs"].skipped and "over 36 values" in checks["token logprobs"].measured

    checks = replay(smollm, "llama_cpp", lambda exchanges: as_llama_cpp_2024(exchanges, probabilities=True))
    assert checks["greedy tokens"].passed, checks["greedy tokens"]  # ids looked up from each token's text
    assert checks["token logprobs"].skipped and "probabilities after sampling" in checks["token logprobs"].measured


def completion(exchanges, i: int = 0) -> dict:
    return answers(exchanges)[i]


MALFORMED = {  # what is wrong -> (the change, the checks that must be SKIP, words their line must hold)
    "logprobs in no shape": (lambda ex: completion(ex)["choices"][0].update(logprobs={"content": "oops"}),
                             "its logprobs are in no shape this ritual reads"),
    "no choice": (lambda ex: completion(ex).update(choices=[]), "IndexError"),
    "a logprob that is text": (lambda ex: completion(ex)["choices"][0]["logprobs"]["content"][0].update(logprob="x"),
                               "a log-probability is 'x', not a number"),
    "a token id past the vocabulary": (lambda ex: completion(ex)["choices"][0]["logprobs"]["content"][0]
                                       .update(id=99999), "token id 99999 is outside the reference's vocabulary"),
    "a list, not an object": (lambda ex: [e.update(answer=[1, 2]) for e in ex if e["path"] == "/v1/completions"],
                              "neither 'choices' nor llama.cpp's 'content'"),
}


@pytest.mark.parametrize("what", MALFORMED)
def test_a_malformed_answer_is_a_one_line_skip(smollm, what):
    change, words = MALFORMED[what]
    checks = replay(smollm, "llama_cpp", change)
    for name in ("tokenizer", "greedy tokens", "token logprobs"):
        assert checks[name].skipped and checks[name].measured.startswith("prompt 0: the /v1/completions answer: ") \
            and words in checks[name].measured, checks[name]
    assert checks["chat template"].passed  # the answers that could be read are still checked


def test_a_malformed_chat_answer_is_a_one_line_skip(smollm):
    def no_message(exchanges):
        answers(exchanges, "/v1/chat/completions")[0]["choices"][0]["message"] = None

    chat = replay(smollm, "llama_cpp", no_message)["chat template"]
    assert chat.skipped and "the /v1/chat/completions answer: in no shape this ritual reads (TypeError" in \
        chat.measured, chat


def test_recorded_answers_through_the_cli(smollm, capsys, monkeypatch, tmp_path):
    """`hardway verify --server` as a learner types it, against the recorded servers: the table, and exit 1 where a
    check fails (llama.cpp's log-probabilities), 0 where every check that could run passed (transformers serve)."""
    prompts = tmp_path / "prompts.txt"
    monkeypatch.setattr("hardway.verify.server.Reference", lambda folder, device: smollm["reference"])
    for name, code in (("llama_cpp", 1), ("transformers_serve", 0)):
        server, record = recorded(name)
        settings = record["settings"]
        prompts.write_text("\n".join(settings["prompts"]) + "\n")
        monkeypatch.setattr("hardway.verify.server.Server", lambda url, model: server)
        assert cli.main(["verify", "--server", server.url, "--model", record["model"], "--reference", "unused",
                         "--prompts", str(prompts), "--new-tokens", str(settings["new_tokens"]), "--top-logprobs",
                         str(settings["top_k"]), "--max-eval-tokens", str(settings["max_eval_tokens"])]) == code
        report = table(capsys)
        assert all(name in report for name in CHECKS) and "not recorded" not in report[""], report[""]
    assert "FAILED" not in report[""] and " SKIP " in report["token logprobs"], report[""]
