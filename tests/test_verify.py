"""The verification ritual and the `hardway` command line, on the SmolLM2-135M stand-in (real weights)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hardway
import hardway.llama as llama_module
from hardway import cli
from hardway.hub import checkpoint
from hardway.tokenizer import load_tokenizer
from hardway.verify import (Check, check_greedy, check_logits, check_perplexity, first_divergent_layer,
                            hidden_state_diffs, load_reference, perplexity, window_nlls)

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
HARDWAY_EXE = Path(sys.executable).with_name("hardway")


@pytest.fixture(scope="module")
def pair():
    folder = checkpoint(SMOLLM2)
    return hardway.load(folder), load_reference(folder), load_tokenizer(folder)


def test_the_command_passes_all_three_checks_on_the_standin(tmp_path):
    # The "done when": `uv run hardway verify --model <the SmolLM2-135M stand-in>` passes on CPU.
    result = subprocess.run([str(HARDWAY_EXE), "verify", "--model", str(checkpoint(SMOLLM2)), "--device", "cpu",
                             "--max-eval-tokens", "1024", "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    for line in ("greedy tokens       PASS    50 of 50 tokens identical", "last-token logits   PASS", "perplexity          PASS"):
        assert line in result.stdout, result.stdout
    assert (tmp_path / "perplexity.png").stat().st_size > 0 and (tmp_path / "hidden_states.png").stat().st_size > 0


def test_fp32_targets_are_far_tighter_than_the_seed(pair):
    ours, theirs, tok = pair
    ids = torch.tensor([tok.encode("The three most important numbers in inference engineering are")])
    assert check_logits(ours, theirs, ids, torch.float32)[1] <= 1e-4
    text = (Path(checkpoint(SMOLLM2)).parent.parent / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    check, a, b = check_perplexity(ours, theirs, torch.tensor(tok.encode(text[:6000])), window=256, stride=128)
    assert abs(perplexity(a) - perplexity(b)) / perplexity(b) <= 1e-4, check.measured


def test_a_broken_model_fails_the_ritual_and_the_diagnostics_name_the_layer(pair, monkeypatch):
    ours, theirs, tok = pair
    ids = torch.tensor([tok.encode("The three most important numbers in inference engineering are")])

    def interleaved(x):  # the wrong RoPE pairing for these weights
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    monkeypatch.setattr(llama_module, "rotate_half", interleaved)
    assert not check_logits(ours, theirs, ids, torch.float32)[0].passed
    assert not check_greedy(ours, theirs, ids, max_new_tokens=10)[0].passed
    assert first_divergent_layer(hidden_state_diffs(ours, theirs, ids), 1e-3) == 1  # the first attention layer


def test_window_nlls_score_every_token_once():
    calls = []

    def uniform(x):  # (1, T) -> (1, T, 10): every next token has probability 1/10
        calls.append(x.shape[1])
        return torch.zeros(1, x.shape[1], 10)

    ids = torch.arange(23) % 10
    nlls = window_nlls(uniform, ids, window=8, stride=5)
    assert sum(n for _, n in nlls) == 22  # every token but the first is predicted exactly once
    assert math.isclose(perplexity(nlls), 10.0, rel_tol=1e-6)
    assert calls[0] == 8


def test_verify_exits_non_zero_when_a_check_fails(monkeypatch, capsys):
    monkeypatch.setattr("hardway.verify.run_ritual",
                        lambda *a, **k: [Check("greedy tokens", False, "first difference at new token 3", "50 identical")])
    assert cli.main(["verify", "--model", "whatever", "--device", "cpu"]) == 1
    assert "FAILED: greedy tokens" in capsys.readouterr().out


def test_generate_streams_the_greedy_text(pair, capsys):
    ours, _, tok = pair
    prompt = "The capital of France is"
    assert cli.main(["generate", "--model", str(checkpoint(SMOLLM2)), "--device", "cpu", "--max-new-tokens", "12", prompt]) == 0
    expected = hardway.generate(ours, torch.tensor([tok.encode(prompt)]), max_new_tokens=12)
    streamed = capsys.readouterr().out
    assert streamed.endswith(tok.decode(expected[0, len(tok.encode(prompt)):].tolist()) + "\n")
    assert streamed.startswith(prompt)


def test_bad_model_argument_is_one_clear_line(capsys):
    assert cli.main(["generate", "--model", "not a repo id!", "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hardway generate: error:") and "not a hub repo id" in err and "Traceback" not in err
