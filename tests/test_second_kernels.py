"""The numerics tests again, under a second set of CPU kernels.

PyTorch picks its vectorised kernels by the CPU's instruction set at start-up, and MKL picks its own: on an AVX-512
machine both use AVX-512 code that sums in other orders than their AVX2 code. A tolerance tuned on one set of kernels
can hold there and fail on a laptop's AVX2 CPU. So the tests that compare numbers with transformers or with a bound
run once more in a child pytest, with both libraries told to use AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS).
On a CPU without AVX-512 that would be the same kernels twice, so the test is skipped there and says why.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
NUMERICS = [  # every comparison against transformers or a rounding bound whose margin depends on the kernels
    "tests/test_contract.py::test_every_architecture_meets_the_contract_in_a_fresh_interpreter",
    "tests/test_verify.py::test_half_precision_logits_are_held_to_transformers_own_distance_from_fp32",
    "tests/test_verify.py::test_the_fp32_stand_in_is_not_flagged_where_its_activations_grow",
    "tests/test_exercises_11.py::test_rounding_only_changes_rounding_by_a_stated_margin",
    "tests/test_exercises_11.py::test_check_find_broken_layer",
    "tests/test_llama.py::test_smollm2_fp32_logits_match_transformers",
    "tests/test_gpt2.py::test_standin_logits_match_transformers",
    "tests/test_batching.py::test_alone_equals_batched_in_fp32[HuggingFaceTB/SmolLM2-135M-Instruct]",
]


def capability(env: dict) -> str:
    result = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_the_numerics_hold_under_avx2_kernels():
    env = {**os.environ, **AVX2}
    if capability(env) != "AVX2":  # the switch must take, or the child would prove nothing
        pytest.skip("this CPU has no AVX2 kernels to switch to")
    if capability(dict(os.environ)) == "AVX2":  # the suite has just run these kernels: a child would repeat them
        pytest.skip("this CPU runs AVX2 kernels already: the numerics tests of this run are the AVX2 run")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", *NUMERICS],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=1500)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]
