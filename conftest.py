"""Test-session setup shared by tests/ and the notebooks that nbmake runs.

The model hub is unreachable in CI, so every test and notebook runs on the offline stand-ins
(tools/standins.py): they are built once (cached) and HARDWAY_MODELS points the loading code at them.
A kernel that nbmake starts inherits this environment.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))


def pytest_configure(config):
    import standins

    folder = Path(os.environ.get("HARDWAY_STANDINS", ROOT / "standins"))
    standins.build(folder)
    os.environ["HARDWAY_MODELS"] = str(folder)
    # Two cores: let torch use both, and keep the notebook kernels from oversubscribing them.
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
