"""Lesson 26's kernel and loader: a GGUF's matrices multiplied as the file stores them. The operator is called by
its name, torch.ops.hardway.gguf_matmul, as the package calls it (tests/test_custom_ops.py says why).

The kernel's reference is the blocks' arithmetic written in torch (dequantize, multiply by the rounded row); the
loaded model's reference is lesson 16's exact reading of the same file (which matches transformers, test_gguf and
test_gemma3_file): rounding the activations moves the predictions a little, never far."""

import ctypes
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

import hardway.kernels.gguf_blocks as gguf_blocks
import hardway.loading as loading
import hardway.server.launch as server_module
from hardway import cli
from hardway.decode.generate import generate
from hardway.engine.engine import Engine
from hardway.engine.sequence import SamplingParams
from hardway.formats.gguf import GGUFError, gemma3_gguf, read_gguf, smollm2_gguf
from hardway.formats.gguf_quants import TENSOR_TYPES
from hardway.course import STANDIN_ID
from hardway.formats.hub import checkpoint, models_dir, shakespeare_path
from hardway.kernels.c_loops import compile_c
from hardway.kernels.gguf_blocks import KERNEL_TYPES, TYPE_IDS, gguf_matmul_torch
from hardway.kernels.gguf_layers import GGUFEmbedding, GGUFLinear
from hardway.loading import load, load_gguf_blocks, open_model
from hardway.server.launch import background_server

SCALES_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
             "Q6_K": [208]}  # where each block keeps its fp16 numbers


def random_blocks(type_name: str, out_features: int, in_features: int, generator) -> torch.Tensor:
    """Random bytes in the layout of `type_name`, (out, bytes a row), the fp16 scales between 0.001 and 0.02."""
    _, per, nbytes = TENSOR_TYPES[TYPE_IDS[type_name]]
    n = out_features * in_features // per
    raw = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=generator)  # (n_blocks, bytes a block)
    for at in SCALES_AT[type_name]:
        raw[:, at:at + 2] = (0.001 + 0.019 * torch.rand(n, 1, generator=generator)).half().view(torch.uint8)
    return raw.reshape(out_features, -1)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_each_type_matches_the_blocks_arithmetic(type_name):
    generator = torch.Generator().manual_seed(TYPE_IDS[type_name])
    blocks = random_blocks(type_name, 24, 768, generator)  # (24, bytes a row): 768 = three K-quant super-blocks
    for rows in (1, 5):  # one decoded token; a short prompt
        x = torch.randn(rows, 768, generator=generator)  # (rows, 768)
        reference = gguf_matmul_torch(x, blocks, type_name)  # (rows, 24)
        assert relative_error(torch.ops.hardway.gguf_matmul.default(x, blocks, TYPE_IDS[type_name]), reference) < 1e-5
        # the rounding is part of the arithmetic: against the unrounded row the answer differs measurably
        exact = x @ gguf_blocks.DEQUANTIZE[type_name](blocks.reshape(-1)).reshape(24, 768).T  # (rows, 24)
        assert relative_error(reference, exact) > 1e-5


def runnable_paths() -> dict:
    """{name: library} of every C path the CPU can run (the generic one always; AVX2 and AVX-512 where it has them)."""
    flags = gguf_blocks.cpu_flags()
    return {name: gguf_blocks.build_kernel(name) for name, (_, needs, _) in gguf_blocks.KERNEL_PATHS.items()
            if set(needs) <= flags}


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_every_path_this_cpu_runs_gives_the_generic_bits(type_name):
    """The vector paths add their floats in the plain loops' order: the same bits, not merely close. Widths with an
    odd number of blocks of 32 (a last unit without a partner) and rows of 1 and 3."""
    paths = runnable_paths()
    assert "generic" in paths
    generator = torch.Generator().manual_seed(10 + TYPE_IDS[type_name])
    for in_features in ((256, 1280) if type_name.endswith("K") else (32, 544, 576)):
        blocks = random_blocks(type_name, 37, in_features, generator)  # (37, bytes a row)
        for rows in (1, 3):
            x = torch.randn(rows, in_features, generator=generator) * 3  # (rows, in)
            reference = gguf_blocks.multiply_with(paths["generic"], x, blocks, TYPE_IDS[type_name])  # (rows, 37)
            for name, library in paths.items():
                assert torch.equal(gguf_blocks.multiply_with(library, x, blocks, TYPE_IDS[type_name]), reference), name


def test_a_path_differing_in_one_float_operation_is_caught(tmp_path):
    """The bit-for-bit check can fail: the generic file with its lanes' tree added in another order differs."""
    source = gguf_blocks.c_source("gguf_generic.c").replace("(r4[0] + r4[2]) + (r4[1] + r4[3])",
                                                             "(r4[0] + r4[1]) + (r4[2] + r4[3])")
    lib_path = compile_c(source, "gguf_reordered", gguf_blocks.GGUF_C_FLAGS)
    if lib_path is None:
        pytest.skip("no C compiler")
    reordered = ctypes.CDLL(str(lib_path))
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    reordered.gguf_matmul.argtypes = [p, n, n, p, i, n, p, i]
    generator = torch.Generator().manual_seed(3)
    blocks = random_blocks("Q8_0", 64, 576, generator)  # (64, bytes a row)
    x = torch.randn(2, 576, generator=generator)  # (2, 576)
    generic = gguf_blocks.build_kernel("generic")
    ours = gguf_blocks.multiply_with(generic, x, blocks, TYPE_IDS["Q8_0"])
    theirs = gguf_blocks.multiply_with(reordered, x, blocks, TYPE_IDS["Q8_0"])
    assert not torch.equal(ours, theirs) and relative_error(theirs, ours) < 1e-6


ARM_TOOLS = ("aarch64-linux-gnu-gcc", "qemu-aarch64")


@pytest.mark.skipif(not all(shutil.which(tool) for tool in ARM_TOOLS),
                    reason="the ARM path needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: apt install "
                           "gcc-aarch64-linux-gnu qemu-user)")
def test_the_arm_path_under_an_emulator_gives_the_generic_bits(tmp_path):
    """gguf_neon.c, cross-compiled for ARMv8.2 with its dot product and run by qemu-user (exact, slow), against the
    generic path run here, on every type."""
    c_dir = Path(gguf_blocks.__file__).parent / "c"
    program = tmp_path / "gguf_neon"
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-ffp-contract=off", "-march=armv8.2-a+dotprod", "-static",
                    "-I", str(c_dir), str(c_dir / "gguf_neon.c"), str(Path(__file__).parent / "c" / "gguf_driver.c"),
                    "-o", str(program)], check=True, capture_output=True)
    generic = gguf_blocks.build_kernel("generic")
    generator = torch.Generator().manual_seed(4)
    for type_name in KERNEL_TYPES:
        in_features = 768 if type_name.endswith("K") else 544
        blocks = random_blocks(type_name, 21, in_features, generator)  # (21, bytes a row)
        x = torch.randn(2, in_features, generator=generator)  # (2, in)
        header = struct.pack("4q", TYPE_IDS[type_name], 2, in_features, 21)
        run = subprocess.run(["qemu-aarch64", str(program)], input=header + x.numpy().tobytes() + blocks.numpy().tobytes(),
                             capture_output=True, check=True)
        arm = torch.frombuffer(bytearray(run.stdout), dtype=torch.float32).reshape(2, 21)
        assert torch.equal(arm, gguf_blocks.multiply_with(generic, x, blocks, TYPE_IDS[type_name])), type_name


def test_the_kernel_is_chosen_by_the_cpu_and_says_why(monkeypatch):
    for flags, expected in (({"avx2", "fma", "f16c"}, "avx2"), (set(), "generic"),
                            ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}, "avx512_vnni")):
        monkeypatch.setattr(gguf_blocks, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(gguf_blocks, "build_kernel", lambda name: object())
        choice = gguf_blocks.choose_kernel()
        assert choice.name == expected
        assert gguf_blocks.KERNEL_PATHS[expected][0] in choice.why
    monkeypatch.setattr(gguf_blocks, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert "not avx512_vnni, the CPU lacks avx512f, avx512bw, avx512vl, avx512_vnni" in gguf_blocks.choose_kernel().why
    with pytest.raises(ValueError, match="the neon kernel needs asimddp, which the CPU lacks"):
        gguf_blocks.choose_kernel(only="neon")


def test_a_failed_build_is_passed_over_with_the_compilers_message(monkeypatch):
    def build(name):
        if name == "avx2":
            raise subprocess.CalledProcessError(1, "cc", stderr="gguf_avx2.c:3:10: error: unknown flag -mavx2\n")
        return object()

    monkeypatch.setattr(gguf_blocks, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(gguf_blocks, "build_kernel", build)
    choice = gguf_blocks.choose_kernel()
    assert choice.name == "generic" and "not avx2, its build failed: gguf_avx2.c:3:10: error: unknown flag" in choice.why
    monkeypatch.setattr(gguf_blocks, "build_kernel", lambda name: (_ for _ in ()).throw(OSError("no C compiler")))
    monkeypatch.setattr(gguf_blocks, "_chosen", None)
    with pytest.warns(RuntimeWarning, match="no C compiler.*multiplied in torch"):
        assert gguf_blocks.gguf_kernel() == "torch"
    monkeypatch.setattr(gguf_blocks, "_chosen", None)


def test_bad_blocks_are_refused_in_one_line():
    blocks = torch.zeros(4, 34, dtype=torch.uint8)  # (4, 34): one Q8_0 block a row
    with pytest.raises(GGUFError, match="Q2_K blocks are not multiplied as they are"):
        GGUFLinear(blocks, "Q2_K", 32)
    if gguf_blocks.gguf_library() is not None:  # the C kernel checks the row's length against the blocks
        with pytest.raises(GGUFError, match="Q8_0 rows of 64 weights are 68 bytes, these are 34"):
            torch.ops.hardway.gguf_matmul.default(torch.randn(1, 64), blocks, TYPE_IDS["Q8_0"])


def agreement(blocks_model, exact_model, ids) -> tuple[float, float]:
    """Top-1 agreement and mean KL(exact || blocks) of the next-token distributions at every position of `ids`."""
    with torch.inference_mode():
        reference = exact_model(ids).log_softmax(-1)  # (1, T, V)
        logp = blocks_model(ids).log_softmax(-1)  # (1, T, V)
    kl = (reference.exp() * (reference - logp)).sum(-1)  # (1, T)
    return (logp.argmax(-1) == reference.argmax(-1)).float().mean().item(), kl.mean().item()


AGREEMENT_POSITIONS = 400  # over 96 positions the agreement moved between 0.92 and 0.99 from one window to the next


def text_ids(path, n: int = AGREEMENT_POSITIONS) -> torch.Tensor:
    tokenizer = open_model(path).tokenizer()
    ids = tokenizer.encode(shakespeare_path().read_text(encoding="utf-8")[:4000])[:n]
    assert len(ids) == n
    return torch.tensor([ids])  # (1, n)


def test_gemma3_q4_k_m_keeps_its_blocks_and_its_predictions():
    path = gemma3_gguf(models_dir() / "gguf")
    model = load_gguf_blocks(path)
    assert [name for name, p in model.named_parameters() if p.dim() >= 2] == []  # no fp32 matrix left
    assert isinstance(model.tok_emb, GGUFEmbedding) and model.lm_head.blocks is model.tok_emb.blocks  # tied: one copy
    file = read_gguf(path)
    assert model.blocks[0].mlp.down_proj.type_name == file.tensors["blk.0.ffn_down.weight"].type_name
    top1, kl = agreement(model, load(path), text_ids(path))
    assert top1 >= 0.95 and kl < 0.01, (top1, kl)


@pytest.fixture(scope="module")
def smollm2_blocks(tmp_path_factory):
    path = smollm2_gguf(tmp_path_factory.mktemp("gguf"))
    return path, load_gguf_blocks(path)


def test_qwen2s_biases_are_kept_beside_the_blocks(tmp_path):
    """Qwen2's q, k and v have biases: the blocks path keeps them (in the stacked projection too). Against the same
    file dequantized (hardway.load), the logits differ by the rounding alone, far less than without the biases."""
    from test_gguf_archs import write_qwen3

    path = write_qwen3(tmp_path / "qwen2-q8_0.gguf", moe=False, arch="qwen2", q8_0=True)
    model, exact = load_gguf_blocks(path), load(path)
    attn = model.blocks[0].attn
    assert isinstance(attn.q_proj, GGUFLinear) and torch.equal(attn.q_proj.bias, exact.blocks[0].attn.q_proj.bias)
    ids = torch.tensor([[1, 17, 42, 99, 3]])  # (1, 5)
    with torch.inference_mode():
        reference = exact(ids)  # (1, 5, V)
        delta = (model(ids) - reference).abs().max().item()
        for block in model.blocks:  # what dropping the biases would give
            for stack in block.attn.qkv_proj.stacks:
                stack.bias = None
        without = (model(ids) - reference).abs().max().item()
    assert delta < without / 10, (delta, without)


def test_smollm2_q4_1_with_the_converters_row_order(smollm2_blocks):
    """A llama file: q and k rows stored permuted, put back in transformers' order (whole rows of blocks)."""
    path, model = smollm2_blocks
    assert model.blocks[0].attn.q_proj.type_name == "Q4_1"
    top1, kl = agreement(model, load(path), text_ids(path))
    assert top1 >= 0.95 and kl < 0.01, (top1, kl)


def test_the_engine_serves_a_model_on_its_blocks(smollm2_blocks):
    """The engine's twin of the model keeps the blocks (no oneDNN copy of them), and its greedy tokens are the
    model's greedy choices. Rounding the activations to int8 makes the last bits of every other operation matter: two
    requests decoded side by side may swap two candidates that are within a tenth of a nat of each other (measured:
    0.10 nats apart where generate() and a batch of two differ). So each token the engine picked must be the best, up
    to such a near-tie, of the model's next-token distribution over the engine's own text."""
    path, model = smollm2_blocks
    tokenizer = open_model(path).tokenizer()
    engine = Engine(model, tokenizer, n_blocks=32, block_size=16, max_batch=2)
    runner_model = engine.runner.model
    assert isinstance(runner_model.blocks[0].attn.q_proj, GGUFLinear)
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("One, two, three,")]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[]))
    for seq, prompt in zip(seqs, prompts):
        with torch.inference_mode():
            logp = model(torch.tensor([prompt + seq.output_ids]))[0, len(prompt) - 1:-1].log_softmax(-1)  # (6, V)
        chosen = logp.gather(-1, torch.tensor(seq.output_ids)[:, None])[:, 0]  # (6,)
        assert (logp.max(-1).values - chosen).max() < 0.25, (seq.output_ids, logp.max(-1).values - chosen)


def recording(monkeypatch, model) -> list:
    """Replaces lesson 26's load_gguf_blocks, which `load(blocks=True)` calls, by one that hands back `model`
    (already loaded) and records its path."""
    calls = []

    def loader(path):
        calls.append(Path(path))
        return model
    monkeypatch.setattr(loading, "load_gguf_blocks", loader)
    return calls


@pytest.mark.parametrize("flags", [[], ["--gguf-blocks"]])
def test_hardway_generate_runs_a_gguf_on_its_blocks_by_default(flags, smollm2_blocks, monkeypatch, capsys):
    """No flag (the default) and the older --gguf-blocks: the blocks path, and one line that says so and which
    kernel multiplies them."""
    path, model = smollm2_blocks
    calls = recording(monkeypatch, model)
    assert cli.main(["generate", "--model", str(path), *flags, "--eager", "--max-new-tokens", "6",
                     "The capital of France is"]) == 0
    tokenizer = open_model(path).tokenizer()
    prompt = tokenizer.encode("The capital of France is")
    expected = generate(model, torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
    out, err = capsys.readouterr()
    assert calls == [path] and out == tokenizer.decode(expected.tolist()) + "\n"
    said = [line for line in err.splitlines() if "runs on its quantized blocks" in line]
    assert len(said) == 1 and f"kernel {gguf_blocks.gguf_kernel()}: hardway/kernels/c/" in said[0], err


def test_hardway_generate_exact_reads_a_gguf_in_fp32(smollm2_blocks, monkeypatch, capsys):
    path, _ = smollm2_blocks
    calls = recording(monkeypatch, None)
    assert cli.main(["generate", "--model", str(path), "--exact", "--eager", "--max-new-tokens", "6",
                     "The capital of France is"]) == 0
    tokenizer = open_model(path).tokenizer()
    prompt = tokenizer.encode("The capital of France is")
    expected = generate(load(path), torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
    out, err = capsys.readouterr()
    assert calls == [] and out == tokenizer.decode(expected.tolist()) + "\n"
    assert "dequantized to float32 on cpu, the exact path (--exact)" in err


def test_which_path_a_gguf_takes_by_default(tmp_path):
    """On the CPU in float32, a model type load_gguf_blocks runs goes on its blocks; a mixture of experts' file, or
    another dtype, is read exactly rather than refused."""
    from test_gguf_archs import write_qwen3

    moe, dense = write_qwen3(tmp_path / "moe.gguf", moe=True), write_qwen3(tmp_path / "dense.gguf", moe=False, q8_0=True)
    args = cli.build_parser().parse_args(["generate", "--model", str(dense), "hi"])
    cpu = torch.device("cpu")
    assert cli._on_blocks(args, open_model(dense), cpu, torch.float32)
    assert not cli._on_blocks(args, open_model(moe), cpu, torch.float32)
    assert not cli._on_blocks(args, open_model(dense), cpu, torch.bfloat16)
    assert not cli._on_blocks(cli.build_parser().parse_args(["generate", "--model", "x", "--exact", "hi"]),
                              open_model(dense), cpu, torch.float32)


def test_load_takes_blocks_and_refuses_what_they_cannot_run(smollm2_blocks, monkeypatch):
    path, model = smollm2_blocks
    calls = recording(monkeypatch, model)
    assert load(path, blocks=True) is model and calls == [path]
    with pytest.raises(ValueError, match="blocks=True runs on the CPU in float32"):
        load(path, dtype=torch.float16, blocks=True)
    with pytest.raises(ValueError, match="blocks=True keeps a .gguf file's quantized blocks"):
        load(checkpoint(STANDIN_ID), blocks=True)


def test_hardway_serve_runs_a_gguf_on_its_blocks_by_default(smollm2_blocks, monkeypatch):
    path, model = smollm2_blocks
    calls = recording(monkeypatch, model)
    got = {}

    class InThisProcess:
        """Stands in for serve's uvicorn server: the app it built, served from a thread here, then stopped."""

        def __init__(self, config, worker, grace_s):
            self.app = config.app

        def run(self):
            with background_server(self.app) as url, httpx.Client(timeout=300) as client:
                got["completion"] = client.post(url + "/v1/completions", json={
                    "model": str(path), "prompt": "One, two, three,", "max_tokens": 6, "temperature": 0}).json()

    monkeypatch.setattr(server_module, "_Server", InThisProcess)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["serve", "--model", str(path), "--eager", "--port", str(port), "--max-batch", "2"]) == 0
    tokenizer = open_model(path).tokenizer()
    prompt = tokenizer.encode("One, two, three,")
    expected = generate(model, torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
    assert calls == [path]
    assert got["completion"]["choices"][0]["text"] == tokenizer.decode(expected.tolist()), got["completion"]


@pytest.mark.parametrize("case", ["a folder", "float16", "both paths"])
def test_gguf_blocks_refuses_what_it_cannot_run(case, capsys):
    model, words = {
        "a folder": (str(checkpoint(STANDIN_ID)), "--gguf-blocks keeps a .gguf file's quantized blocks"),
        "float16": (str(gemma3_gguf(models_dir() / "gguf")), "--gguf-blocks runs on the CPU in float32"),
        "both paths": (str(gemma3_gguf(models_dir() / "gguf")), "--exact and --gguf-blocks ask for opposite paths")}[case]
    more = {"float16": ["--dtype", "float16"], "both paths": ["--exact"]}.get(case, [])
    assert cli.main(["generate", "--model", model, "--device", "cpu", *more, "--gguf-blocks", "hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hardway generate: error: ") and words in lines[0], lines
