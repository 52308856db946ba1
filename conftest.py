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
    if not hasattr(config, "workerinput"):  # the main process builds them once; the test workers it starts reuse them
        standins.build(folder)
    os.environ["HARDWAY_MODELS"] = str(folder)
    # pytest-xdist runs the tests in `-n` worker processes at once (pyproject): the cores are shared among them, one
    # thread each on two cores, so torch's threads never outnumber the cores. The workers inherit this environment,
    # and so does every notebook kernel they start.
    workers = getattr(config.option, "numprocesses", None) or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
