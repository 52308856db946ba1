"""benchmarks/gpu_check.py, the one prepared GPU check, rehearsed on CPU with --dry-run: a tiny Llama (GQA, tied head,
llama3 RoPE scaling) goes through every step the GPU run takes except the CUDA ones (CUDA graphs, CUDA events, GPU
memory), so a GPU session does not discover a Python error after minutes of compiling. The numbers it prints on CPU are
not measurements of anything; the checks with a target must pass."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run_gpu_check(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "benchmarks/gpu_check.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_dry_run_passes_every_check_and_prints_one_table():
    result = run_gpu_check("--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    summary = result.stdout.split("gpu_check summary:")[1]
    rows = {line.split("  ")[0]: line for line in summary.splitlines()[3:] if line.strip()}
    for check in ("fp32 compiled vs eager tokens", "float16 greedy tokens vs transformers",
                  "bfloat16 greedy tokens vs transformers", "float16 logits: max |Δ| from fp32",
                  "bfloat16 logits: max |Δ| from fp32", "compilations of the step",
                  "bf16 compiled vs eager, teacher-forced"):
        assert " PASS " in rows[check], rows.get(check, f"no row {check!r} in:\n{summary}")
    assert "FAIL" not in summary
    assert "1 graph(s)" in rows["compilations of the step"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the real run is the script's, not a test's")
def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    result = run_gpu_check()
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--dry-run" in result.stderr
