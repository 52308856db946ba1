"""The verification ritual and the `hardway` command line, on the SmolLM2-135M stand-in (real weights)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hardway.decode.static as fast_decode
import hardway.models.llama as llama_module
from hardway import cli
from hardway.models.llama import apply_rope_interleaved  # lesson 09's true interleaved RoPE, one of lesson 11's five bugs
from hardway.exercises.lesson_11 import rounding_only  # lesson 11: a change of rounding only
from hardway.decode.generate import generate
from hardway.formats.hub import checkpoint, shakespeare_path
from hardway.loading import forward_once, load
from hardway.text.tokenizer import load_tokenizer
from hardway.verify.ritual import (DEFAULT_PROMPT, EMBEDDINGS, TOLERANCE, Check, attention_diffs, check_greedy, check_logits, check_perplexity, comparison_attention, diagnosis, eval_text, first_divergent_layer, half_precision_bar, hidden_state_diffs, layer_name, load_reference, perplexity, reference_logits, relative_divergence, rounding_step, window_nlls)

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
GPT2 = "openai-community/gpt2"
HARDWAY_EXE = Path(sys.executable).with_name("hardway")


@pytest.fixture(scope="module")
def pair():
    folder = checkpoint(SMOLLM2)
    return load(folder), load_reference(folder), load_tokenizer(folder)


def test_the_command_passes_all_three_checks_on_the_standin(tmp_path):
    # `uv run hardway verify --model <the SmolLM2-135M stand-in>` passes on CPU, diagnostics included: the installed
    # command, in a process of its own. 768 tokens of text: two overlapping perplexity windows of 512.
    result = subprocess.run([str(HARDWAY_EXE), "verify", "--model", str(checkpoint(SMOLLM2)), "--device", "cpu",
                             "--max-eval-tokens", "768", "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    for line in ("greedy tokens       PASS    50 of 50 tokens identical", "last-token logits   PASS", "perplexity          PASS",
                 "diagnostics (info)  PASS    no layer diverges (relative divergence ≤ 0.0001;"):
        assert line in result.stdout, result.stdout
    assert (tmp_path / "perplexity.png").stat().st_size > 0 and (tmp_path / "hidden_states.png").stat().st_size > 0


def test_gpt2_standin_passes_the_command_with_a_local_text_file(tmp_path, capsys):
    # GPT-2, the course's first model, end to end through the command's main (the installed command itself is run
    # above); perplexity on a user's own UTF-8 file.
    corpus = tmp_path / "my corpus.txt"
    corpus.write_text("Ceci n'est pas une pipe. « Guillemets », naïve café, 東京. " * 40, encoding="utf-8")
    code = cli.main(["verify", "--model", str(checkpoint(GPT2)), "--device", "cpu", "--new-tokens", "20", "--text",
                     str(corpus), "--out", str(tmp_path / "plots")])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    for line in ("greedy tokens       PASS    20 of 20 tokens identical", "last-token logits   PASS",
                 "perplexity          PASS", "of my corpus.txt", "diagnostics (info)  PASS    no layer diverges"):
        assert line in out, out
    assert (tmp_path / "plots" / "hidden_states.png").stat().st_size > 0


@pytest.mark.parametrize("content, problem", [(None, "no such file"), (b"\xff\xfe\x00bad", "not UTF-8"),
                                              (b"  \n", "empty")])
def test_a_bad_text_file_is_one_clear_line_before_any_model_loads(tmp_path, capsys, monkeypatch, content, problem):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setattr("hardway.loading.ModelSource.load",
                        lambda *a, **k: pytest.fail("loaded a model for a bad --text"))
    assert cli.main(["verify", "--model", str(checkpoint(GPT2)), "--device", "cpu", "--text", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hardway verify: error: --text") and problem in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_eval_text_reads_a_local_utf8_file(tmp_path):
    (tmp_path / "t.txt").write_text("naïve — 東京\n", encoding="utf-8")
    assert eval_text(tmp_path / "t.txt") == ("t.txt", "naïve — 東京\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_a_gpu_is_one_clear_line(capsys):
    assert cli.main(["generate", "--model", str(checkpoint(GPT2)), "--device", "cuda", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hardway generate: error: --device cuda") and "no CUDA GPU" in err


def test_a_bad_device_name_is_one_clear_line(capsys):
    assert cli.main(["generate", "--model", str(checkpoint(GPT2)), "--device", "gpu0", "hi"]) == 2
    assert "is not a device name" in capsys.readouterr().err


def test_diagnostics_work_through_the_contract_on_gpt2():
    folder = checkpoint(GPT2)
    ours, theirs, tok = load(folder), load_reference(folder), load_tokenizer(folder)
    ids = torch.tensor([tok.encode("Hello, my name is John and I")])
    diffs = hidden_state_diffs(ours, theirs, ids)
    assert diffs.layers == list(range(-1, ours.config.n_layer))  # the embeddings, then layers 0 .. n - 1
    assert len(diffs.absolute) == len(diffs.relative) == diffs.per_position.shape[0] == ours.config.n_layer + 1
    assert first_divergent_layer(diffs.relative, TOLERANCE[torch.float32].hidden_state) is None
    attn = attention_diffs(ours, theirs, ids, layer=3)
    assert set(attn) == {"q", "k", "v", "attention probabilities"} and max(attn.values()) <= 1e-4, attn
    assert theirs.config._attn_implementation == "sdpa"  # the reference is switched back


def test_fp32_targets_are_far_tighter_than_the_half_precision_ones(pair):
    ours, theirs, tok = pair
    ids = torch.tensor([tok.encode(DEFAULT_PROMPT)])
    assert check_logits(ours, theirs, ids, torch.float32)[1] <= 1e-4
    text = shakespeare_path().read_text(encoding="utf-8")
    check, a, b = check_perplexity(ours, theirs, torch.tensor(tok.encode(text[:6000])), window=256, stride=128)
    assert abs(perplexity(a) - perplexity(b)) / perplexity(b) <= 1e-4, check.measured


def test_half_precision_logits_are_held_to_transformers_own_distance_from_fp32(pair):
    """bf16: ours may be no further from transformers' fp32 logits than transformers' bf16 logits are, plus one bf16
    step at the logits' size. Our model passes; the same model with its final norm 10% off (the logits 10% larger)
    measured 1.75 from fp32, 3.8 times the bar of 0.46, and must land at least twice the bar away: no CPU's rounding
    decides it."""
    tok = pair[2]
    folder = checkpoint(SMOLLM2)
    ids = torch.tensor([tok.encode(DEFAULT_PROMPT)])
    reference = reference_logits(folder, ids)  # (1, vocab) fp32
    ours, theirs = load(folder, dtype=torch.bfloat16), load_reference(folder, dtype=torch.bfloat16)
    with comparison_attention():
        check, _ = check_logits(ours, theirs, ids, torch.bfloat16, reference)
        assert check.passed and "hardway" in check.measured and "transformers" in check.measured, check.measured
        theirs_gap = (theirs(ids).logits[:, -1].float() - reference).abs().max().item()
        bar = half_precision_bar(theirs_gap, reference, torch.bfloat16)
        with torch.no_grad():
            ours.final_norm.weight.mul_(1.10)
        broken, _ = check_logits(ours, theirs, ids, torch.bfloat16, reference)
        broken_gap = (forward_once(ours, ids)[:, -1].float() - reference).abs().max().item()
    assert not broken.passed and broken_gap > 2 * bar, (broken.measured, bar)


def test_one_rounding_step_is_the_spacing_of_the_dtype():
    assert rounding_step(torch.bfloat16, 30.0) == 0.125 and rounding_step(torch.bfloat16, 16.0) == 0.125
    assert rounding_step(torch.float16, 30.0) == 2.0 ** -6 and rounding_step(torch.bfloat16, 0.0) == 0.0
    x = torch.tensor(30.0, dtype=torch.bfloat16)
    assert (torch.nextafter(x, torch.tensor(64.0, dtype=torch.bfloat16)) - x).item() == rounding_step(torch.bfloat16, 30.0)


def test_a_broken_model_fails_the_ritual_and_the_diagnostics_name_the_layer(pair, monkeypatch):
    ours, theirs, tok = pair
    ids = torch.tensor([tok.encode(DEFAULT_PROMPT)])
    assert max(attention_diffs(ours, theirs, ids, layer=0).values()) <= 1e-4  # q, k, v and probabilities agree
    monkeypatch.setattr(llama_module, "apply_rope", apply_rope_interleaved)
    assert not check_logits(ours, theirs, ids, torch.float32)[0].passed
    assert not check_greedy(ours, theirs, ids, max_new_tokens=10)[0].passed
    diffs = hidden_state_diffs(ours, theirs, ids)
    assert first_divergent_layer(diffs.relative, TOLERANCE[torch.float32].hidden_state) == 0  # the first block
    assert (diffs.per_position[:, 0] <= 1e-5).all()  # position 0: angle 0, the same in either convention
    broken = attention_diffs(ours, theirs, ids, layer=0)
    assert broken["q"] > 1e-2 and broken["k"] > 1e-2 and broken["v"] <= 1e-4, broken  # RoPE: q and k, not v
    line = diagnosis(diffs, TOLERANCE[torch.float32].hidden_state, broken)
    assert line.startswith("first divergent layer: layer 0 (relative divergence "), line


def test_relative_divergence_is_per_position_and_scale_free():
    h_ref = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))  # (B, T, C)
    h = h_ref + 1e-3 * torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    rel = relative_divergence(h, h_ref)  # (B, T)
    assert rel.shape == (2, 4) and rel.dtype == torch.float32
    torch.testing.assert_close(relative_divergence(1000 * h, 1000 * h_ref), rel)  # scale-free
    torch.testing.assert_close(relative_divergence(2 * h_ref, h_ref), torch.ones(2, 4))
    giant_ref, giant = h_ref.clone(), h.clone()
    giant_ref[0, 0, 0] = giant[0, 0, 0] = 1e4  # a huge activation at one position leaves the others' measure alone
    torch.testing.assert_close(relative_divergence(giant, giant_ref)[:, 1:], rel[:, 1:])
    assert relative_divergence(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)).item() == 0  # no 0/0


def test_first_divergent_layer_numbers_layers_from_the_first_block():
    assert first_divergent_layer([0.0, 0.0, 0.5, 0.5], 0.1) == 1  # stage 2 is layer 1's output
    assert first_divergent_layer([0.5, 0.5], 0.1) == EMBEDDINGS == -1
    assert first_divergent_layer([0.0, 0.05], 0.1) is None
    assert layer_name(EMBEDDINGS, 30) == "the embeddings (the input to layer 0)"
    assert layer_name(3, 30) == "layer 3" and layer_name(29, 30) == "layer 29 (or the final norm after it)"


def test_the_fp32_stand_in_is_not_flagged_where_its_activations_grow(pair):
    """SmolLM2's activations grow to ~2e4 halfway up. The untouched model stays at rounding level on the relative
    measure, far under its threshold, at every layer. With the rounding changed on purpose (every weight moved by
    sixteen fp32 steps, lesson 11's rounding_only: how far another CPU's kernels may land) max |Δ| follows the
    activations' size, over a hundred times the relative measure, and the relative measure still does not move."""
    ours, theirs, tok = pair
    ids = torch.tensor([tok.encode(DEFAULT_PROMPT)])
    assert max(hidden_state_diffs(ours, theirs, ids).relative) < TOLERANCE[torch.float32].hidden_state / 10
    with rounding_only(ours):
        diffs = hidden_state_diffs(ours, theirs, ids)
    assert max(diffs.absolute) > 1e2 * max(diffs.relative)  # the absolute measure follows the activations' size
    assert max(diffs.relative) < TOLERANCE[torch.float32].hidden_state / 10


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_a_single_broken_layer_is_flagged_at_that_layer(pair, layer):
    ours, theirs, tok = pair
    ids = torch.tensor([tok.encode(DEFAULT_PROMPT)])
    weight = ours.blocks[layer].mlp.down_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(1.01)  # 1% off, in one layer only
    try:
        diffs = hidden_state_diffs(ours, theirs, ids)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert first_divergent_layer(diffs.relative, TOLERANCE[torch.float32].hidden_state) == layer


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
    monkeypatch.setattr("hardway.verify.ritual.run_ritual",
                        lambda *a, **k: [Check("greedy tokens", False, "first difference at new token 3", "50 identical")])
    assert cli.main(["verify", "--model", "whatever", "--device", "cpu"]) == 1
    assert "FAILED: greedy tokens" in capsys.readouterr().out


def test_generate_streams_the_greedy_text(pair, capsys):
    ours, _, tok = pair
    prompt = "The capital of France is"
    assert cli.main(["generate", "--model", str(checkpoint(SMOLLM2)), "--device", "cpu", "--max-new-tokens", "12", prompt]) == 0
    expected = generate(ours, torch.tensor([tok.encode(prompt)]), max_new_tokens=12)
    captured = capsys.readouterr()
    streamed = captured.out  # the generated text alone; the echoed prompt goes to stderr
    assert streamed == tok.decode(expected[0, len(tok.encode(prompt)):].tolist()) + "\n"
    assert prompt in captured.err


def eager_compiled_steps(monkeypatch) -> list:
    """Make lesson 12's StaticDecodeStep, as the command line and the ritual reach it, run dynamo's graph as captured
    (backend "eager": the plumbing under test, not inductor, which tests/test_fast_decode.py checks); returns the
    steps made."""
    made = []

    class EagerBackendStep(fast_decode.StaticDecodeStep):
        def __init__(self, model, max_len, batch_size=1, **kwargs):
            super().__init__(model, max_len, batch_size, backend="eager", **kwargs)
            made.append(self)

    monkeypatch.setattr(fast_decode, "StaticDecodeStep", EagerBackendStep)  # hardway.cli imports it when it runs
    return made


def test_generate_compile_streams_the_same_text_through_the_compiled_step(pair, capsys, monkeypatch):
    ours, _, tok = pair
    prompt = "The capital of France is"
    argv = ["generate", "--model", str(checkpoint(SMOLLM2)), "--device", "cpu", "--max-new-tokens", "12", prompt]
    assert cli.main(argv) == 0
    eager_text = capsys.readouterr().out
    made = eager_compiled_steps(monkeypatch)
    torch._dynamo.reset()
    assert cli.main(argv + ["--compile"]) == 0
    assert capsys.readouterr().out == eager_text
    # hardway.generate's shared step: a static cache of at least 256 positions (a power of two), reused by later calls
    assert len(made) == 1 and made[0].kv_cache.max_len == 256 >= len(tok.encode(prompt)) + 12


def test_check_greedy_with_the_compiled_step_passes_and_says_so(pair, monkeypatch):
    ours, theirs, tok = pair
    ids = torch.tensor([tok.encode(DEFAULT_PROMPT)])
    eager_compiled_steps(monkeypatch)
    torch._dynamo.reset()
    step = fast_decode.StaticDecodeStep(ours, max_len=ids.shape[1] + 10)
    check, a, b = check_greedy(ours, theirs, ids, 10, decoder=step)
    assert check.passed and check.name == "greedy tokens (EagerBackendStep)", check
    assert torch.equal(a, generate(ours, ids, 10))


def test_verify_compile_reaches_the_ritual(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr("hardway.verify.ritual.run_ritual", lambda *a, **k: seen.update(k) or [Check("x", True, "", "")])
    assert cli.main(["verify", "--model", "whatever", "--device", "cpu", "--compile"]) == 0
    assert seen["compile"] is True
    assert cli.main(["verify", "--model", "whatever", "--device", "cpu"]) == 0
    assert seen["compile"] is False


def test_bad_model_argument_is_one_clear_line(capsys):
    assert cli.main(["generate", "--model", "not a repo id!", "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hardway generate: error:") and "not a hub repo id" in err and "Traceback" not in err


def test_the_ritual_and_its_diagnostics_on_qwen2(tmp_path):
    # Qwen2 (q/k/v biases) through the same functions: nothing in verify knows which architecture it looks at.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(tmp_path)
    ours, theirs = load(tmp_path), load_reference(tmp_path)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    assert check_logits(ours, theirs, ids, torch.float32)[0].passed
    assert check_greedy(ours, theirs, ids, max_new_tokens=10)[0].passed
    assert check_perplexity(ours, theirs, torch.randint(0, 128, (200,)), window=32, stride=16)[0].passed
    diffs = hidden_state_diffs(ours, theirs, ids)
    assert first_divergent_layer(diffs.relative, TOLERANCE[torch.float32].hidden_state) is None
    assert max(attention_diffs(ours, theirs, ids, layer=1).values()) <= 1e-4


def test_a_file_transformers_cannot_read_is_one_line_and_exit_code_2(monkeypatch, capsys):
    """transformers' own reader failing (its GGUF reader on some architectures raises a TypeError) is the reference
    missing, said in one line: `hardway verify` exits 2 with it, no traceback."""
    import hardway.verify.ritual as ritual

    def unreadable(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for *: 'NoneType' and 'float'")

    monkeypatch.setattr(ritual.AutoModelForCausalLM, "from_pretrained", unreadable)
    with pytest.raises(ValueError, match="transformers cannot read .* as the reference: TypeError: unsupported") as e:
        load_reference(checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert "\n" not in str(e.value)
    assert cli.main(["verify", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("transformers cannot read" in line for line in err) and not any("Traceback" in l for l in err), err
