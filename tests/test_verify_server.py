"""`hardway verify --server` (lesson 18): it passes on `hardway serve` (fp32, both stand-ins), and it catches servers
broken on purpose here, each by the check that should catch it, with a message naming what differs:

- a wrong chat template (an outdated default system message): the chat template check;
- RoPE's base changed (rope_theta 10000 where the checkpoint says 100000): the token logprobs;
- a tokenizer with one special token off by one (<|im_end|> read as id 3, not 2): the chat template check;
- log-probabilities computed from bf16 logits: the token logprobs (its fp32 bar is 1e-4; bf16 rounds 2^-8 of a value).

An unreachable server, and one that offers nothing the ritual can use, are one line and exit 2; a failed check is
the table and exit 1. Everything listens on 127.0.0.1 only.
"""
import copy
import json

import pytest
import torch
from fastapi import FastAPI
from test_server import GPT2, SMOLLM2, free_port

from hardway import cli
from hardway import server as server_module
from hardway import serving
from hardway.chat import ChatTemplate
from hardway.hub import checkpoint
from hardway.loading import load
from hardway.prefix_cache import PrefixCachingEngine
from hardway.server import create_app
from hardway.serving import Engine
from hardway.tokenizer import load_tokenizer
from hardway.verify_server import Reference, Server as Endpoint, ServerUnusable, background_server, run_server_ritual

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
    monkeypatch.setattr("hardway.verify_server.Reference", lambda folder, device: smollm["reference"])
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
    monkeypatch.setattr("hardway.verify_server.Reference", lambda folder, device: smollm["reference"])
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

    monkeypatch.setattr(serving, "token_logprobs", from_bf16)       # new tokens (Engine's hook)
    monkeypatch.setattr(server_module, "token_logprobs", from_bf16)  # prompt tokens (echo)
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

    monkeypatch.setattr("hardway.verify_server.Reference", lambda folder, device: smollm["reference"])
    with background_server(app) as url:
        code = verify_cli(url, smollm)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "answers neither /completions (404" in err[0] and \
        "nothing to verify" in err[0], err
    with background_server(app) as url, pytest.raises(ServerUnusable, match="serves .*, not 'gpt-9'"):
        Endpoint(url, "gpt-9").check()
