"""Lesson 13's batching and `hardway chat`: left-padded batches equal transformers' batched generate and each prompt
alone; bad masks are refused in one line; the chat command through a pseudo-terminal."""

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hardway
from hardway.instruments.agreement import batch_invariance
from hardway.decode.batching import encode_batch, left_pad
from hardway.text.chat import ChatTemplate
from hardway.chat_cli import chat_loop
from hardway.formats.hub import checkpoint
from hardway.text.tokenizer import load_tokenizer
from test_contract import tiny_checkpoint  # tiny GPT-2, Llama and Qwen2 checkpoints written by transformers

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
GPT2 = "openai-community/gpt2"
PROMPTS = ["The capital of France is", "Hi", "Once upon a time, in a land far away, there lived a"]
NEW_TOKENS = 6


def _batch(folder, pad_id):
    """The three prompts, left-padded: input_ids (3, T), attention_mask (3, T)."""
    return encode_batch(load_tokenizer(folder), PROMPTS, pad_id=pad_id)


def _tiny_batch(vocab_size=128):
    """Three random prompts of lengths 7, 3 and 5 for the tiny models, left-padded with id 0."""
    g = torch.Generator().manual_seed(1)
    return left_pad([torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (7, 3, 5)], pad_id=0)


CASES = {  # name -> (folder maker, dtype)
    "gpt2-standin-fp32": (lambda tmp: checkpoint(GPT2), torch.float32),
    "smollm2-standin-fp32": (lambda tmp: checkpoint(SMOLLM2), torch.float32),
    "smollm2-standin-bf16": (lambda tmp: checkpoint(SMOLLM2), torch.bfloat16),
    "gpt2-tiny-fp32": (lambda tmp: tiny_checkpoint("gpt2", tmp / "gpt2"), torch.float32),
    "llama-tiny-fp32": (lambda tmp: tiny_checkpoint("llama", tmp / "llama"), torch.float32),
    "qwen2-tiny-fp32": (lambda tmp: tiny_checkpoint("qwen2", tmp / "qwen2"), torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_batched_greedy_equals_transformers(case, tmp_path):
    make_folder, dtype = CASES[case]
    folder = make_folder(tmp_path)
    input_ids, attention_mask = _tiny_batch() if "tiny" in case else _batch(folder, pad_id=0)
    assert (attention_mask == 0).any(), "the batch must be padded to test anything"
    model = hardway.load(folder, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ours = hardway.generate(model, input_ids, NEW_TOKENS, attention_mask=attention_mask, eos_token_id=None)
    with torch.inference_mode():
        theirs = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.tolist() == theirs.tolist(), f"{case}: batched greedy tokens differ from transformers'"


def test_batched_sampling_equals_transformers(tmp_path):
    """Sampled, the same draws from the same seeded global RNG: same processors, same probabilities, same tokens."""
    folder = tiny_checkpoint("llama", tmp_path / "llama")
    input_ids, attention_mask = _tiny_batch()
    model = hardway.load(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(7)
    ours = hardway.generate(model, input_ids, 8, hardway.SamplingConfig(do_sample=True, temperature=0.8, top_k=20),
                            attention_mask=attention_mask, eos_token_id=None)
    torch.manual_seed(7)
    with torch.inference_mode():
        theirs = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=True,
                                    temperature=0.8, top_k=20, top_p=1.0, eos_token_id=None, pad_token_id=0)
    assert ours.tolist() == theirs.tolist()


@pytest.mark.parametrize("name", [GPT2, SMOLLM2])
def test_alone_equals_batched_in_fp32(name):
    """Batch invariance, the tokens: each prompt alone and as row 0 of batches of 2 and 3, differently padded."""
    folder = checkpoint(name)
    tokenizer = load_tokenizer(folder)
    model = hardway.load(folder, dtype=torch.float32)
    rows = batch_invariance(model, [tokenizer.encode(p) for p in PROMPTS], batch_sizes=(2, 3), new_tokens=NEW_TOKENS)
    assert {r["padding"] for r in rows} != {0}, "no prompt was padded"
    changed = [r for r in rows if not r["same_tokens"]]
    assert not changed, f"tokens changed inside a batch: {changed}"
    # and the logits moved by rounding only, relative to their size
    assert max(r["max_abs_logit_diff"] for r in rows) < 1e-3, rows


def test_cached_decode_follows_the_mask():
    """The mask reaches every cached decode step: padded and cached equals padded and recomputed every step."""
    folder = checkpoint(SMOLLM2)
    model = hardway.load(folder)
    input_ids, attention_mask = _batch(folder, pad_id=2)
    cached = hardway.generate(model, input_ids, NEW_TOKENS, attention_mask=attention_mask, eos_token_id=None)
    naive = hardway.generate(model, input_ids, NEW_TOKENS, attention_mask=attention_mask, eos_token_id=None,
                             use_cache=False)
    assert cached.tolist() == naive.tolist()


# ---- bad input ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return hardway.load(tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama"))


MASK = torch.tensor([[0, 1, 1], [1, 1, 1]])
BAD_MASKS = {
    "shape": (MASK[:, 1:], r"attention_mask has shape \(2, 2\) but input_ids has \(2, 3\)"),
    "right padding": (torch.tensor([[1, 1, 0], [1, 1, 1]]), r"row 0 of attention_mask is right-padded: left padding is expected"),
    "hole": (torch.tensor([[1, 1, 1], [1, 0, 1]]), r"row 1 of attention_mask has a hole .*left padding is expected"),
    "all padding": (torch.tensor([[0, 1, 1], [0, 0, 0]]), r"row 1 of attention_mask is all padding"),
    "not 0/1": (torch.tensor([[0, 2, 1], [1, 1, 1]]), r"only 0 \(padding\) and 1"),
    "float": (MASK.float(), r"only 0 \(padding\) and 1"),
}


@pytest.mark.parametrize("problem", list(BAD_MASKS))
def test_bad_attention_masks_get_one_line(problem, tiny_model):
    mask, message = BAD_MASKS[problem]
    with pytest.raises(ValueError, match=message) as error:
        hardway.generate(tiny_model, torch.ones(2, 3, dtype=torch.long), 2, attention_mask=mask)
    assert "\n" not in str(error.value)


def test_forward_refuses_a_mask_of_the_wrong_length(tiny_model):
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 3\).*needs \(2, 4\)"):
        tiny_model(torch.ones(2, 1, dtype=torch.long), kv_cache=tiny_model.new_kv_cache(2, 8), start_pos=3,
                   attention_mask=MASK)


def test_left_pad_refuses_empty_input():
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        left_pad([[1, 2], []])
    with pytest.raises(ValueError, match="non-empty list"):
        left_pad([])
    with pytest.raises(ValueError, match="list of prompts"):
        encode_batch(load_tokenizer(checkpoint(SMOLLM2)), "one prompt")


def test_chat_loop_drops_the_oldest_messages_to_fit():
    folder = checkpoint(SMOLLM2)
    model, chat = hardway.load(folder), ChatTemplate.from_folder(folder)
    lines = iter(["What is the capital of France?", "And of Italy?", "And of Spain?"])

    def read(prompt):
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    out = io.StringIO()
    assert chat_loop(model, chat, max_new_tokens=16, max_context=86, read=read, out=out) == 0
    assert "(dropped the 2 oldest message(s) to keep the conversation within 86 tokens)" in out.getvalue()


def _cli(*args):
    return [sys.executable, "-c", "import sys; from hardway.cli import main; sys.exit(main())", *args]


class Terminal:
    """A child process on a pseudo-terminal: type into it, read what it prints (Ctrl-C and Ctrl-D act as in a shell)."""

    def __init__(self, argv):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its stdin/stdout/stderr are the terminal
            # A test runner started in the background by a shell inherits SIGINT ignored, and an ignored signal stays
            # ignored across exec: Python then never raises KeyboardInterrupt. Ctrl-C must act as in a terminal.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(argv[0], argv, {**os.environ, "PYTHONUNBUFFERED": "1"})
        self.text = ""

    def read_until(self, pattern: str, timeout: float = 600) -> str:
        """Read until `pattern` (a regex) appears in the output since the last call; return that output."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout}s; got {self.text[-2000:]!r}")
            ready, _, _ = select.select([self.fd], [], [], 1.0)
            if ready:
                try:
                    self.text += os.read(self.fd, 4096).decode("utf-8", errors="replace")
                except OSError:  # the child closed the terminal
                    break
        match = re.search(pattern, self.text)
        if match is None:
            raise AssertionError(f"the program ended before {pattern!r}; got {self.text[-2000:]!r}")
        seen, self.text = self.text[:match.end()], self.text[match.end():]
        return seen

    def type(self, keys: str):
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                os.read(self.fd, 4096)  # keep draining so the child never blocks on a full terminal
            except OSError:
                pass
            time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the program did not exit")


def test_hardway_chat_in_a_pseudo_terminal():
    folder = checkpoint(SMOLLM2)
    model, chat = hardway.load(folder), ChatTemplate.from_folder(folder)
    question = "What is the capital of France?"
    ids = torch.tensor([chat.encode([{"role": "user", "content": question}], add_generation_prompt=True)])
    end_ids = chat.end_of_turn_ids()
    # Room for a long answer, so the story below is still streaming when Ctrl-C arrives on a loaded machine (the
    # answer to this question ends with its end-of-turn token long before).
    out = hardway.generate(model, ids, 300, eos_token_id=end_ids)[0, ids.shape[1]:].tolist()
    expected = chat.tokenizer.decode([i for i in out if i not in end_ids])

    term = Terminal(_cli("chat", "--model", SMOLLM2, "--max-new-tokens", "300"))
    term.read_until(r"you> ")
    term.type(question + "\r")
    answer = term.read_until(r"\r\nyou> ")
    streamed = answer.split("bot> ", 1)[1].rsplit("\r\nyou> ", 1)[0].replace("\r\n", "\n")
    assert streamed == expected, (streamed, expected)

    # Ctrl-C in the middle of a long answer stops the answer, and the session goes on
    term.type("Tell me a long story about a dragon and a knight.\r")
    term.read_until(r"bot> \S[^\r\n]{10}")  # the answer has started streaming
    term.type("\x03")
    assert "[stopped]" in term.read_until(r"\r\nyou> ")
    term.type("Thanks!\r")
    term.read_until(r"bot> [\s\S]*\r\nyou> ")
    term.type("\x04")  # Ctrl-D at the prompt: a clean exit
    assert term.wait() == 0


def test_generate_chat_one_shot():
    folder = checkpoint(SMOLLM2)
    model, chat = hardway.load(folder), ChatTemplate.from_folder(folder)
    question = "Name a colour."
    ids = torch.tensor([chat.encode([{"role": "user", "content": question}], add_generation_prompt=True)])
    end_ids = chat.end_of_turn_ids()
    out = hardway.generate(model, ids, 12, eos_token_id=end_ids)[0, ids.shape[1]:].tolist()
    expected = chat.tokenizer.decode([i for i in out if i not in end_ids])
    result = subprocess.run(_cli("generate", "--model", SMOLLM2, "--chat", "--max-new-tokens", "12", question),
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    printed = "".join(l for l in result.stdout.splitlines(keepends=True) if "STAND-IN" not in l)  # the stand-in notice
    assert printed == expected + "\n"


def test_chat_needs_a_chat_template():
    result = subprocess.run(_cli("chat", "--model", GPT2), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 2
    lines = [l for l in result.stderr.splitlines() if l.strip() and "STAND-IN" not in l]
    assert len(lines) == 1 and "has no chat template" in lines[0], result.stderr
