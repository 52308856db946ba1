"""Bad input gets one clear line, never a traceback or a silently wrong result (findings 7, 8 and 9 of the
hostile-user review): devices, config.json values, token ids, sampling arguments, prompts, `verify --out`, Ctrl-C.

The API cases run in this process on tiny checkpoints that transformers writes. The command-line cases run the real
`hardway` command in subprocesses: the simple ones all at once (module fixture), since each pays for importing torch.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from forked import run_forked

from hardway.errors import CheckpointError, ConfigError
from hardway.decode.generate import generate
from hardway.decode.sampling import SamplingConfig
from hardway.formats.hub import checkpoint
from hardway.loading import load
from hardway.text.tokenizer import load_tokenizer
from hardway.verify.ritual import run_ritual

ROOT = Path(__file__).resolve().parent.parent
HARDWAY_EXE = Path(sys.executable).with_name("hardway")
GPT2_STANDIN = "openai-community/gpt2"
N_POSITIONS = 64  # the tiny GPT-2's context


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny checkpoints: GPT-2 with GPT-2's real vocabulary and tokenizer files (so the CLI can run on it), and
    Llama with 128 tokens."""
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_layer=2, n_head=2, n_embd=16, n_positions=N_POSITIONS,
                               bos_token_id=50256, eos_token_id=50256)).save_pretrained(root / "gpt2")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(checkpoint(GPT2_STANDIN) / name, root / "gpt2" / name)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=128, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=1,
                                 eos_token_id=2)).save_pretrained(root / "llama")
    shutil.copytree(root / "gpt2", root / "gpt2-standin")  # a STANDIN.md makes checkpoint() print a banner
    (root / "gpt2-standin" / "STANDIN.md").write_text("# A tiny stand-in for the tests\n")
    return SimpleNamespace(gpt2=root / "gpt2", llama=root / "llama", standin=root / "gpt2-standin", root=root)


@pytest.fixture(scope="module")
def gpt2(tiny):
    return load(tiny.gpt2)


def variant(tiny, tmp_path, base: str, edit=None, raw: str | None = None, file="config.json") -> Path:
    """A copy of a tiny checkpoint with `file` edited (edit(dict) in place) or replaced by `raw` text."""
    folder = tmp_path / base
    shutil.copytree(getattr(tiny, base), folder)
    path = folder / file
    if raw is None:
        settings = json.loads(path.read_text())
        edit(settings)
        raw = json.dumps(settings)
    path.write_text(raw)
    return folder


# --- finding 7: bad config.json values are a ConfigError naming the file and the key ---------------------------

def drop(key):
    return lambda c: c.pop(key)


def put(key, value):
    return lambda c: c.__setitem__(key, value)


LLAMA3_WITHOUT_FACTOR = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CONFIG_CASES = {  # name -> (checkpoint, edit or raw text, words the message must hold besides the file's path)
    "gpt2 without n_embd": ("gpt2", drop("n_embd"), ["missing", "'n_embd'"]),
    "gpt2 n_embd as a string": ("gpt2", put("n_embd", "768"), ["n_embd must be an integer", "'768'"]),
    "gpt2 n_head 0": ("gpt2", put("n_head", 0), ["n_head must be an integer >= 1", "got 0"]),
    "gpt2 n_layer true": ("gpt2", put("n_layer", True), ["n_layer must be an integer", "True"]),
    "gpt2 layer_norm_epsilon as a string": ("gpt2", put("layer_norm_epsilon", "1e-5"), ["layer_norm_epsilon"]),
    "a JSON list": ("gpt2", "[1, 2, 3]", ["must hold a JSON object", "[1, 2, 3]"]),
    "invalid JSON": ("gpt2", '{"n_embd": 768,', ["is not valid JSON", "line 1"]),
    "model_type a list": ("gpt2", put("model_type", ["gpt2"]), ["model_type ['gpt2']", "supported"]),
    "llama3 rope without factor": ("llama", put("rope_parameters", LLAMA3_WITHOUT_FACTOR), ["llama3", "'factor'"]),
    "llama3 rope with equal ramp ends": ("llama", put("rope_parameters", dict(LLAMA3_WITHOUT_FACTOR, factor=8.0,
                                                                              high_freq_factor=1.0)),
                                         ["low_freq_factor equals high_freq_factor"]),
    "llama rope_scaling a string": ("llama", lambda c: (c.pop("rope_parameters"), c.__setitem__("rope_scaling", "x")),
                                    ["rope_scaling must be an object"]),
    "llama num_attention_heads as a string": ("llama", put("num_attention_heads", "4"), ["num_attention_heads", "'4'"]),
    "llama hidden_size not divisible": ("llama", lambda c: (c.pop("head_dim"), c.__setitem__("hidden_size", 66)),
                                        ["hidden_size=66 is not divisible by num_attention_heads=4"]),
    "llama without hidden_size": ("llama", drop("hidden_size"), ["missing", "'hidden_size'"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_bad_config_value_is_a_config_error_naming_the_file_and_the_key(tiny, tmp_path, case):
    base, change, words = CONFIG_CASES[case]
    folder = variant(tiny, tmp_path, base, raw=change) if isinstance(change, str) else variant(tiny, tmp_path, base, change)
    with pytest.raises(ConfigError) as info:
        load(folder)
    message = str(info.value)
    assert str(folder / "config.json") in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("value", ["2", "12", 2.0, True, [2, "3"], -1])
@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_an_eos_token_id_that_is_not_an_integer_names_its_file(tiny, tmp_path, value, file):
    # "12" used to become [1, 2] (a string iterated digit by digit): silently wrong EOS ids.
    folder = variant(tiny, tmp_path, "llama", put("eos_token_id", value), file=file)
    if file == "config.json":
        (folder / "generation_config.json").unlink()  # else it would decide the EOS ids
    with pytest.raises(ConfigError, match="eos_token_id must be an integer") as info:
        load(folder)
    assert str(folder / file) in str(info.value)


def test_good_eos_settings_still_load(tiny, tmp_path):
    folder = variant(tiny, tmp_path, "llama", put("eos_token_id", [2, 5]), file="generation_config.json")
    assert load(folder).eos_token_ids == [2, 5]
    assert load(tiny.llama).eos_token_ids == [2]


# --- finding 7: devices and dtypes --------------------------------------------------------------------------------

def test_load_takes_a_dtype_by_name(tiny):
    assert load(tiny.gpt2, dtype="float16").wte.weight.dtype == torch.float16
    assert load(tiny.gpt2, dtype="bfloat16").wte.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype 'float17': hardway computes in float32, float16, bfloat16"):
        load(tiny.gpt2, dtype="float17")
    with pytest.raises(ValueError, match="dtype torch.int64"):
        load(tiny.gpt2, dtype=torch.int64)


MISSING_DEVICES = ["banana", "mps"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"]) + (
    ["cuda:1"] if torch.cuda.device_count() == 1 else [])


@pytest.mark.parametrize("device", MISSING_DEVICES)
def test_load_on_a_device_this_machine_lacks_is_a_value_error(tiny, device):
    with pytest.raises(ValueError, match=r"device .*(not a device name|no CUDA GPU|CUDA device\(s\)|cpu or cuda)"):
        load(tiny.gpt2, device=device)


# --- finding 7: token ids, and tensors on the wrong device --------------------------------------------------------

@pytest.mark.parametrize("bad_id", [50257, 10**6, -1])
def test_a_token_id_outside_the_vocabulary_is_named(gpt2, bad_id):
    ids = torch.tensor([[464, bad_id, 3332]])
    for call in (lambda: generate(gpt2, ids, max_new_tokens=2), lambda: gpt2(ids)):
        with pytest.raises(ValueError, match=rf"token id {bad_id} is not in this model's vocabulary: ids run from 0 "
                                             rf"to 50256"):
            call()


def test_a_token_id_outside_llamas_vocabulary_is_named(tiny):
    with pytest.raises(ValueError, match="token id 128 is not in this model's vocabulary"):
        generate(load(tiny.llama), torch.tensor([[1, 128]]), max_new_tokens=2)


def test_token_ids_on_another_device_than_the_model_are_named(gpt2, tiny):
    other = "cuda" if torch.cuda.is_available() else "meta"  # meta: a device with no data, on any machine
    for model in (gpt2, load(tiny.llama)):
        with pytest.raises(ValueError, match=rf"the token ids are on {other}.*the model on cpu"):
            generate(model, torch.tensor([[1, 2]], device=other), max_new_tokens=2)


def test_a_generator_on_another_device_is_named(gpt2):
    # Without a GPU, a torch.Generator exists only on the CPU: an object with another device stands in for one.
    generator = (torch.Generator(device="cuda") if torch.cuda.is_available()
                 else SimpleNamespace(device=torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r"the generator is on cuda:0, the token ids on cpu"):
        generate(gpt2, torch.tensor([[464, 3797]]), max_new_tokens=2, sampling=SamplingConfig(do_sample=True),
                 generator=generator)


# --- finding 8: integers are integers (bools out, numpy in), numbers are finite ----------------------------------

IDS = torch.tensor([[464, 3797, 3332]])
SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


def generate_with(model, ids, **kwargs):
    """generate, with the sampling settings among `kwargs` grouped into the SamplingConfig it takes."""
    sampling = SamplingConfig(**{k: kwargs.pop(k) for k in SAMPLING_FIELDS if k in kwargs})
    return generate(model, ids, sampling=sampling, **kwargs)


@pytest.mark.parametrize("kwargs, words", [
    (dict(do_sample=True, top_k=True), "top_k must be an integer, got True"),
    (dict(do_sample=True, temperature=True), "temperature must be a finite number, got True"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer, got 2.0"),
    (dict(do_sample=True, top_p=True), "top_p must be a finite number, got True"),
    (dict(repetition_penalty=True), "repetition_penalty must be a finite number, got True"),
    (dict(do_sample=True, temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(do_sample=True, temperature=-1.0), "temperature must be a positive number, got -1.0"),
    (dict(top_p=1.5), r"top_p must be a number in \[0, 1\], got 1.5"),  # greedy: checked even though unused
    (dict(temperature=-1.0), "temperature must be a positive number"),  # greedy too
    (dict(top_k=-2), "top_k must be an integer >= 0, got -2"),
    (dict(eos_token_id="2"), "eos_token_id must be an integer, got '2'"),
])
def test_a_bad_sampling_argument_is_a_value_error(gpt2, kwargs, words):
    with pytest.raises(ValueError, match=words):
        generate_with(gpt2, IDS, **({"max_new_tokens": 3} | kwargs))


def test_numpy_numbers_are_taken_like_python_ones(gpt2):
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    plain = generate_with(gpt2, IDS, max_new_tokens=3, do_sample=True, top_k=5, top_p=0.9, temperature=0.7,
                          generator=g())
    numpy = generate_with(gpt2, IDS, max_new_tokens=np.int64(3), do_sample=True, top_k=np.int32(5),
                          top_p=np.float32(0.9), temperature=np.float64(0.7), generator=g())
    assert torch.equal(plain, numpy)
    assert generate(gpt2, IDS, max_new_tokens=np.int64(2), eos_token_id=np.int64(7)).shape == (1, 5)


# --- finding 9: an empty prompt, a prompt longer than the context -------------------------------------------------

def test_an_empty_prompt_says_it_is_empty(gpt2):
    for empty in (torch.tensor([[]]), torch.zeros(1, 0, dtype=torch.long)):  # the first is float, as torch makes it
        with pytest.raises(ValueError, match=r"the prompt is empty \(input_ids of shape \(1, 0\)\)"):
            generate(gpt2, empty, max_new_tokens=3)


def test_a_long_prompt_says_how_many_new_tokens_fit(gpt2):
    with pytest.raises(ValueError, match=r"the prompt is 60 tokens; with max_new_tokens=10 that makes 70, more than "
                                         r"the model's context of 64 tokens: ask for at most 4 new tokens"):
        generate(gpt2, torch.zeros(1, 60, dtype=torch.long), max_new_tokens=10)
    for T in (N_POSITIONS, 2001):  # never "at most 0" or "at most -1937 new tokens"
        with pytest.raises(ValueError, match=rf"the prompt is {T} tokens.*the prompt alone fills it; shorten it to "
                                             rf"at most 63 tokens"):
            generate(gpt2, torch.zeros(1, T, dtype=torch.long), max_new_tokens=1)


# --- weights that hold NaN or infinite values are refused at load, naming the tensor ------------------------------

def with_weight(source: Path, folder: Path, suffix: str, value: float) -> Path:
    """A copy of a checkpoint whose tensor ending in `suffix` has `value` in its first element."""
    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    name = next(n for n in tensors if n.endswith(suffix))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_weight_that_is_not_finite_is_refused_at_load_naming_the_tensor(tiny, tmp_path, value):
    # One NaN in ln_f.bias used to make every logit NaN: `hardway generate` printed "!!!!!!!!" and exited 0.
    folder = with_weight(tiny.gpt2, tmp_path / "damaged", "ln_f.bias", value)
    with pytest.raises(CheckpointError, match=r"tensor '[\w.]*ln_f\.bias' holds NaN or infinite values: the "
                                              r"checkpoint is damaged"):
        load(folder)


def test_a_weight_beyond_float16s_range_is_refused_in_float16_only(tiny, tmp_path):
    folder = with_weight(tiny.gpt2, tmp_path / "large", "ln_f.weight", 1e6)  # float16's largest is 65504
    assert load(folder).final_norm is not None  # float32 holds it
    with pytest.raises(CheckpointError, match=r"ln_f\.weight' has values beyond the range of torch.float16"):
        load(folder, dtype=torch.float16)


# --- finding 9: verify checks its --out folder first and hands over the checks before it plots --------------------

def test_run_ritual_reports_the_checks_before_it_writes_a_plot(tiny, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    seen = []

    def report(checks):
        seen.append(([c.name for c in checks], sorted(p.name for p in (tmp_path / "plots").iterdir())))

    checks = run_ritual(tiny.gpt2, new_tokens=5, text_file=text, out_dir=tmp_path / "plots", report=report)
    assert seen == [([c.name for c in checks], [])]  # called once, with every check, before any plot existed
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["hidden_states.png", "perplexity.png"]


# --- the command line: every error above is one line on stderr and exit code 2 -----------------------------------

def hardway(*args, **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # several at once on two cores
    return subprocess.run([str(HARDWAY_EXE), *map(str, args)], capture_output=True, text=True, timeout=900, env=env,
                          **kwargs)


def cli_cases(tiny) -> dict[str, tuple[list, str]]:
    """name -> (the command's arguments, what its one line on stderr must say)."""
    gen = ["generate", "--model", tiny.gpt2, "--device", "cpu"]
    bad = tiny.root / "bad"
    if not bad.exists():
        shutil.copytree(tiny.gpt2, bad / "string-n-embd")
        config = json.loads((bad / "string-n-embd" / "config.json").read_text())
        (bad / "string-n-embd" / "config.json").write_text(json.dumps(config | {"n_embd": "768"}))
        shutil.copytree(tiny.gpt2, bad / "invalid-json")
        (bad / "invalid-json" / "config.json").write_text('{"n_embd": 16,')
        (bad / "a-file").write_text("not a folder")
        with_weight(tiny.gpt2, bad / "nan-weight", "ln_f.bias", float("nan"))
    cases = {
        "--device banana": (["generate", "--model", tiny.gpt2, "--device", "banana", "hi"],
                            "--device 'banana' is not a device name"),
        "--device mps": (["generate", "--model", tiny.gpt2, "--device", "mps", "hi"], "--device mps: hardway runs on "
                                                                                        "cpu or cuda"),
        "--temperature -1": ([*gen, "--temperature", "-1", "hi"], "temperature must be a positive number, got -1.0"),
        "--temperature nan": ([*gen, "--temperature", "nan", "hi"], "temperature must be a finite number, got nan"),
        "--top-p 1.5 greedy": ([*gen, "--top-p", "1.5", "hi"], "top_p must be a number in [0, 1], got 1.5"),
        "--top-k -1": ([*gen, "--top-k", "-1", "hi"], "top_k must be an integer >= 0, got -1"),
        "--max-new-tokens 0": ([*gen, "--max-new-tokens", "0", "hi"], "max_new_tokens must be an integer >= 1, got 0"),
        "empty prompt": ([*gen, ""], "the prompt is empty"),
        "prompt longer than the context": ([*gen, "--max-new-tokens", "5", "word" + " word" * 69],
                                           "the prompt is 70 tokens; with max_new_tokens=5 that makes 75, more than "
                                           "the model's context of 64 tokens: the prompt alone fills it"),
        "prompt leaves room for a few": ([*gen, "--max-new-tokens", "20", "word" + " word" * 49],
                                         "ask for at most 14 new tokens"),
        "config n_embd as a string": (["generate", "--model", bad / "string-n-embd", "--device", "cpu", "hi"],
                                      f"{bad / 'string-n-embd' / 'config.json'}: n_embd must be an integer, got '768'"),
        "config invalid JSON": (["generate", "--model", bad / "invalid-json", "--device", "cpu", "hi"],
                                f"{bad / 'invalid-json' / 'config.json'} is not valid JSON"),
        "a NaN in a weight": (["generate", "--model", bad / "nan-weight", "--device", "cpu", "hi"],
                              "ln_f.bias' holds NaN or infinite values: the checkpoint is damaged"),
        # The model is the GPT-2 stand-in, whose checkpoint() prints a banner: none means it failed before that.
        "verify --out under a file": (["verify", "--model", checkpoint(GPT2_STANDIN), "--device", "cpu",
                                       "--out", bad / "a-file" / "plots"],
                                      f"cannot write the plots into {bad / 'a-file' / 'plots'}: Not a directory"),
    }
    if not torch.cuda.is_available():
        cases["--device cuda"] = (["generate", "--model", tiny.gpt2, "--device", "cuda", "hi"],
                                  "--device cuda: this machine has no CUDA GPU")
    if torch.cuda.device_count() < 2:
        cases["--device cuda:1"] = (["generate", "--model", tiny.gpt2, "--device", "cuda:1", "hi"], "--device cuda:1:")
    return cases


@pytest.fixture(scope="module")
def cli_results(tiny, tmp_path_factory):
    """Each case's command, as the installed `hardway` runs it (its entry point, hardway.cli:main), in a child forked
    from one process that imported torch and transformers once. The other tests here run the installed command."""
    cases = cli_cases(tiny)
    runs = run_forked([("hardway.cli:main", args) for args, _ in cases.values()], ["torch", "transformers"],
                      tmp_path_factory.mktemp("cli"), ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"})
    return cases, dict(zip(cases, runs))


CLI_CASE_NAMES = ["--device banana", "--device mps", "--device cuda", "--device cuda:1", "--temperature -1",
                  "--temperature nan", "--top-p 1.5 greedy", "--top-k -1", "--max-new-tokens 0", "empty prompt",
                  "prompt longer than the context", "prompt leaves room for a few", "config n_embd as a string",
                  "config invalid JSON", "a NaN in a weight", "verify --out under a file"]


@pytest.mark.parametrize("name", CLI_CASE_NAMES)
def test_the_command_answers_bad_input_with_one_line_and_exit_code_2(cli_results, name):
    cases, results = cli_results
    if name not in cases:
        pytest.skip("this machine has that device")
    args, words = cases[name]
    result = results[name]
    command = args[0]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no banner, no echoed prompt: the error alone
    assert lines[0].startswith(f"hardway {command}: error: ") and words in lines[0], lines[0]
    assert result.stdout == "", result.stdout


def test_the_command_prints_the_checks_before_a_plot_fails_to_save(tiny, tmp_path):
    # perplexity.png is a folder, so saving that plot fails after every check has run: the table must be out first.
    (tmp_path / "plots" / "perplexity.png").mkdir(parents=True)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    result = hardway("verify", "--model", tiny.gpt2, "--device", "cpu", "--new-tokens", "5", "--text", text,
                     "--out", tmp_path / "plots")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "greedy tokens       PASS" in result.stdout and "diagnostics (info)" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("hardway verify: error: "), result.stderr
    assert "perplexity.png" in result.stderr


def test_generate_writes_the_text_alone_to_stdout(tiny):
    # On a stand-in, whose checkpoint() prints a banner: the banner and the echoed prompt go to stderr.
    prompt = "The capital of France is"
    result = hardway("generate", "--model", tiny.standin, "--device", "cpu", "--max-new-tokens", "8", prompt)
    assert result.returncode == 0, result.stderr
    tokenizer = load_tokenizer(tiny.standin)
    expected = generate(load(tiny.standin), torch.tensor([tokenizer.encode(prompt)]), max_new_tokens=8)
    assert result.stdout == tokenizer.decode(expected[0, len(tokenizer.encode(prompt)):].tolist()) + "\n"
    assert "STAND-IN" in result.stderr and prompt in result.stderr and "STAND-IN" not in result.stdout


def test_ctrl_c_during_generate_keeps_the_text_and_exits_130_without_a_traceback():
    folder = checkpoint(GPT2_STANDIN)  # GPT-2's real size: 1000 new tokens take long enough to interrupt
    process = subprocess.Popen([str(HARDWAY_EXE), "generate", "--model", str(folder), "--device", "cpu",
                                "--max-new-tokens", "1000", "Once upon a time"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               # SIGINT as in a terminal, even when this runner inherited it ignored (a shell's
                               # background job): an ignored signal stays ignored across exec
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = os.read(process.stdout.fileno(), 4096)  # blocks until the first streamed text arrives
        assert first, process.stderr.read().decode()
        process.send_signal(signal.SIGINT)
        rest, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    err = err.decode()
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].startswith("hardway generate: interrupted after "), err
    out = (first + rest).decode()
    assert out.startswith(first.decode()) and len(out.strip()) > 0  # the text so far is kept
