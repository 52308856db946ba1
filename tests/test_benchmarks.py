"""Every benchmark script imports what it needs from hardway: `--help` runs its imports and its argument parser.

One Python process imports torch and transformers once (most of a script's start-up time); each script then runs as
`script --help` in a child forked from it, so no script sees a hardway module, a sys.path entry or anything else that
another script loaded. Where there is no fork, each script runs in a process of its own."""

import subprocess
from pathlib import Path

import pytest

from forked import run_forked

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """`SCRIPT --help` of every script: its return code, stdout and stderr. torch and transformers, which every
    script imports, are imported once; hardway is left to each script."""
    results = run_forked([(str(s), ["--help"]) for s in SCRIPTS], ["torch", "transformers"],
                         tmp_path_factory.mktemp("help"), ROOT)
    return {s.name: r for s, r in zip(SCRIPTS, results)}


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_benchmark_script_starts(script, runs):
    run = runs[script.name]
    assert run.returncode == 0, f"{script.name} --help failed:\n{run.stderr[-2000:]}"
    assert "usage:" in run.stdout


def test_qwen35_cache_arithmetic_counts_what_transformers_keeps():
    """benchmarks/qwen35.py's cache bytes (its table and plot are arithmetic from the config) against the tensors
    transformers' own caches hold after a prefill: a small Qwen3.5 (value heads != key heads, d_k != d_v, so that a
    swapped size shows) and a Qwen3 with its sizes and every layer attention."""
    import importlib.util

    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    spec = importlib.util.spec_from_file_location("qwen35_benchmark", ROOT / "benchmarks" / "qwen35.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    config = {**sizes, "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
              + ["full_attention"] * 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4}
    T = 11
    ids = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(0))  # (1, T)
    torch.manual_seed(0)
    with torch.inference_mode():
        cache = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).eval()(ids, use_cache=True).past_key_values
        dense = Qwen3ForCausalLM(Qwen3Config(**sizes)).eval()(ids, use_cache=True).past_key_values
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if hasattr(layer, "keys"))
    conv = sum(t.nbytes for layer in cache.layers if hasattr(layer, "conv_states") for t in layer.conv_states.values())
    recurrent = sum(t.nbytes for layer in cache.layers if hasattr(layer, "recurrent_states")
                    for t in layer.recurrent_states.values())
    ours = bench.cache_bytes(config, T)
    assert (ours["kv"], ours["recurrent"]) == (kv, recurrent)
    # transformers keeps the convolution's last K inputs; the next output needs only the last K - 1 (llama.cpp and
    # hardway keep K - 1), so the benchmark counts K - 1
    assert ours["conv"] * 4 == conv * 3
    assert bench.cache_bytes(bench.attention_only(config), T)["kv"] == sum(
        layer.keys.nbytes + layer.values.nbytes for layer in dense.layers)
