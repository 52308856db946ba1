"""One way to name a model, for `hardway.load` and every command: a hub id (here found among the stand-ins), a
checkpoint folder, or a `.gguf` file, all three SmolLM2-135M-Instruct. Each command is run in this process on each
kind of name (`generate`, `chat`, `verify`, `serve` with `verify --server` against it), and its output is compared
with `generate` on the model that name loads. A name that is no model gets the same one line from every command.

Loading is the slow part, so each model is loaded once for the module: `ModelSource.load` and transformers' reference
are remembered by the files they read (two of each: the safetensors, and the GGUF), and the commands are handed the
model already loaded from the same files. Which source each command opened is recorded and checked."""

import io
import json
import socket

import httpx
import pytest
import torch

import hardway
import hardway.server.launch as server_module
import hardway.verify.ritual as verify_module
import hardway.verify.server as verify_server_module
from hardway import chat_cli, cli
from hardway.text.chat import ChatTemplate
from hardway.decode.generate import generate
from hardway.formats.gguf import smollm2_gguf
from hardway.formats.hub import checkpoint
from hardway.loading import ModelSource, open_model
from hardway.server.launch import background_server

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
KINDS = ["hub", "folder", "gguf"]
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
N_NEW = 6
FOLDER_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


@pytest.fixture(scope="module")
def names(tmp_path_factory) -> dict[str, str]:
    """The same model named three ways: its hub id, a folder of its files outside the models folder (no stand-in
    banner), and its Q4_1 GGUF alone in a folder of its own."""
    standin = checkpoint(SMOLLM2)
    folder = tmp_path_factory.mktemp("folder") / "smollm2"
    folder.mkdir()
    for name in FOLDER_FILES:
        (folder / name).symlink_to(standin / name)
    return {"hub": SMOLLM2, "folder": str(folder), "gguf": str(smollm2_gguf(tmp_path_factory.mktemp("gguf")))}


def weights_file(source: ModelSource):
    return (source.path if source.kind == "gguf" else source.path / "model.safetensors").resolve()


@pytest.fixture(scope="module")
def loaded() -> dict:
    models = {}
    yield models
    models.clear()  # four models of 135M parameters: not kept for the rest of the worker's tests


@pytest.fixture
def opened(loaded, monkeypatch) -> list[ModelSource]:
    """ModelSource.load and lesson 11's load_reference, each model loaded once for the module; returns the list of
    sources the code under test loaded, in order."""
    real_load, real_reference = ModelSource.load, verify_module.load_reference
    sources = []

    def load(self, device="cpu", dtype=torch.float32, blocks=False, compiled=None):
        sources.append(self)
        key = ("ours", weights_file(self), str(dtype), blocks, compiled)
        if key not in loaded:
            loaded[key] = real_load(self, device, dtype, blocks=blocks, compiled=compiled)
        return loaded[key]

    def load_reference(model, device="cpu", dtype=torch.float32):
        source = open_model(model)
        key = ("theirs", weights_file(source), str(dtype))
        if key not in loaded:
            loaded[key] = real_reference(source, device, dtype)
        return loaded[key]

    monkeypatch.setattr(ModelSource, "load", load)
    monkeypatch.setattr(verify_module, "load_reference", load_reference)
    monkeypatch.setattr(verify_server_module, "load_reference", load_reference)
    return sources


def expect_source(sources: list[ModelSource], names: dict, kind: str) -> ModelSource:
    """Every model the command loaded is the one its name means: the kind, the path, and the name as given."""
    assert sources, "the command loaded no model"
    want = {"hub": ("folder", checkpoint(SMOLLM2)), "folder": ("folder", names["folder"]),
            "gguf": ("gguf", names["gguf"])}[kind]
    for s in sources:
        assert (s.name, s.kind, str(s.path)) == (names[kind], want[0], str(want[1])), s
    return sources[0]


def continuation(model, ids: list[int], n: int, stop_ids) -> list[int]:
    """hardway.generate's greedy tokens after `ids`, cut before the first of `stop_ids`."""
    out = generate(model, torch.tensor([ids]), max_new_tokens=n, eos_token_id=list(stop_ids))[0, len(ids):].tolist()
    return out[:next((i for i, t in enumerate(out) if t in stop_ids), len(out))]


@pytest.fixture(scope="module")
def folder_chat() -> ChatTemplate:
    """The checkpoint folder's own chat template and tokenizer: what every kind must encode a conversation as."""
    return ChatTemplate.from_folder(checkpoint(SMOLLM2))


def test_every_kind_opens_to_the_same_model(names, folder_chat):
    messages = [{"role": "user", "content": QUESTION}]
    for kind, name in names.items():
        source = open_model(name)
        assert source.kind == ("gguf" if kind == "gguf" else "folder") and source.name == name
        assert open_model(source) is source
        assert source.tokenizer().encode(PROMPT) == folder_chat.tokenizer.encode(PROMPT), kind
        chat = source.chat_template()  # the GGUF's from its metadata: the same template, the same special tokens
        assert chat.encode(messages, add_generation_prompt=True) == \
            folder_chat.encode(messages, add_generation_prompt=True), kind
        assert chat.end_of_turn_ids() == folder_chat.end_of_turn_ids(), kind
    assert open_model(names["gguf"]).from_pretrained_args() == \
        (str(open_model(names["gguf"]).path.parent), {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"})


def test_a_folder_named_from_the_home_folder(names, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "smollm2").symlink_to(names["folder"])
    source = open_model("~/smollm2")
    assert (source.name, source.kind, source.path) == ("~/smollm2", "folder", tmp_path / "smollm2")


@pytest.mark.parametrize("kind", KINDS)
def test_load(kind, names, opened):
    model = hardway.load(names[kind])  # the same resolution as the commands': open_model, then ModelSource.load
    assert model is expect_source(opened, names, kind).load()


@pytest.mark.parametrize("kind", KINDS)
def test_generate(kind, names, opened, folder_chat, capsys):
    assert cli.main(["generate", "--model", names[kind], PROMPT, "--max-new-tokens", str(N_NEW)]) == 0
    source = expect_source(opened, names, kind)
    tokenizer = folder_chat.tokenizer
    model = source.load(blocks=kind == "gguf")  # a .gguf runs on its blocks by default (lesson 26)
    expected = continuation(model, tokenizer.encode(PROMPT), N_NEW, model.eos_token_ids)
    assert len(expected) > 0
    assert capsys.readouterr().out.strip() == tokenizer.decode(expected).strip()


@pytest.mark.parametrize("kind", KINDS)
def test_chat(kind, names, opened, folder_chat, monkeypatch):
    lines, transcript, chat_loop = iter([QUESTION]), io.StringIO(), chat_cli.chat_loop

    def read(prompt):  # one message, then the end of input (Ctrl-D)
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(chat_cli, "chat_loop",  # hardway.cli imports it when it runs
                        lambda *a, **k: chat_loop(*a, read=read, out=transcript, **k))
    assert cli.main(["chat", "--model", names[kind], "--max-new-tokens", str(N_NEW)]) == 0
    source = expect_source(opened, names, kind)
    ids = folder_chat.encode([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    expected = continuation(source.load(blocks=kind == "gguf"), ids, N_NEW, folder_chat.end_of_turn_ids())
    out = transcript.getvalue()
    answers = [line.split("bot> ", 1)[1] for line in out.splitlines() if "bot> " in line]
    assert answers == [folder_chat.tokenizer.decode(expected)], out


@pytest.mark.parametrize("kind", KINDS)
def test_verify(kind, names, opened, capsys, tmp_path):
    """Lesson 11's ritual on each kind: transformers reads the same files (a .gguf through gguf_file=)."""
    assert cli.main(["verify", "--model", names[kind], "--device", "cpu", "--prompt", PROMPT, "--new-tokens", "4",
                     "--max-eval-tokens", "16", "--out", str(tmp_path)]) == 0, capsys.readouterr().out
    expect_source(opened, names, kind)
    out = capsys.readouterr().out
    assert "greedy tokens       PASS    4 of 4 tokens identical" in out and "all checks passed" in out, out
    assert (tmp_path / "perplexity.png").stat().st_size > 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", KINDS)
def test_serve_then_verify_server(kind, names, opened, folder_chat, capsys, monkeypatch, tmp_path):
    """`hardway serve --model NAME` serves that model under that name: /v1/models lists the name as given, a greedy
    completion is generate's tokens on the same loaded model, and `verify --server` with the same name as
    --reference passes against it."""
    got = {}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n", encoding="utf-8")

    class InThisProcess:
        """Stands in for serve's uvicorn server (which takes over the main thread's signals): the app it built,
        served from a thread here, asked what the test wants, then stopped; serve then returns."""

        def __init__(self, config, worker, grace_s):
            self.app = config.app

        def run(self):
            with background_server(self.app) as url:
                got["models"] = httpx.get(url + "/v1/models", timeout=30).json()
                got["completion"] = httpx.post(url + "/v1/completions", timeout=300, json={
                    "model": names[kind], "prompt": PROMPT, "max_tokens": N_NEW, "temperature": 0}).json()
                got["verify"] = cli.main(["verify", "--server", url, "--model", names[kind], "--reference",
                                          names[kind], "--new-tokens", "2", "--max-eval-tokens", "16",
                                          "--prompts", str(prompts)])

    monkeypatch.setattr(server_module, "_Server", InThisProcess)
    # --exact: the ritual holds a server to transformers' fp32 numbers, which a .gguf's blocks path (its default,
    # tests/test_gguf_blocks.py) is not meant to give
    exact = ["--exact"] if kind == "gguf" else []
    assert cli.main(["serve", "--model", names[kind], *exact, "--port", str(free_port()), "--max-batch", "2"]) == 0
    source = expect_source(opened, names, kind)
    assert [m["id"] for m in got["models"]["data"]] == [names[kind]]
    model = source.load()
    expected = continuation(model, folder_chat.tokenizer.encode(PROMPT), N_NEW, model.eos_token_ids)
    assert got["completion"]["choices"][0]["text"] == folder_chat.tokenizer.decode(expected), got["completion"]
    assert got["completion"]["usage"]["completion_tokens"] == len(expected)
    out = capsys.readouterr().out
    assert got["verify"] == 0, out


def not_a_model(tmp_path, problem: str) -> tuple[str, str]:
    """A name that is no model, and words its error line must hold."""
    if problem == "missing file":
        return str(tmp_path / "nowhere" / "model.gguf"), "no such file or folder"
    if problem == "not a GGUF":
        path = tmp_path / "notes.gguf"
        path.write_text("these are my notes, not a model; " * 4, encoding="utf-8")
        return str(path), "not a GGUF file"
    if problem == "no config.json":
        folder = tmp_path / "weights"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
        return str(folder), "has no config.json"
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}), encoding="utf-8")
    return str(folder), "model_type 'bert'"


COMMANDS = {
    "generate": lambda name, tmp_path: ["generate", "--model", name, "hello"],
    "chat": lambda name, tmp_path: ["chat", "--model", name],
    "verify": lambda name, tmp_path: ["verify", "--model", name, "--out", str(tmp_path / "plots")],
    "serve": lambda name, tmp_path: ["serve", "--model", name, "--port", str(free_port())],
}


@pytest.mark.parametrize("problem", ["missing file", "not a GGUF", "no config.json", "unknown model_type"])
def test_every_command_refuses_a_name_that_is_no_model_in_the_same_line(problem, tmp_path, capsys, monkeypatch):
    name, words = not_a_model(tmp_path, problem)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises((OSError, ValueError)) as e:
        hardway.load(name)
    assert words in str(e.value) and name in str(e.value) and "\n" not in str(e.value)
    for command, argv in COMMANDS.items():
        assert cli.main(argv(name, tmp_path)) == 2, command
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"hardway {command}: error: {e.value}\n"), command
