"""Test-session setup shared by tests/ and the notebooks that nbmake runs.

The model hub is unreachable in CI, so every test and notebook runs on the offline stand-ins
(tools/standins.py): they are built once (cached) and HARDWAY_MODELS points the loading code at them.
A kernel that nbmake starts inherits this environment.
"""

import ctypes
import gc
import os
import sys
from pathlib import Path

import pytest

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
    # Eager decoding by default (hardway.load's layout, hardway.generate, `hardway generate` and `hardway serve`): most
    # tests and notebooks check tokens and shapes, and compiling would only slow them down. The tests of the compiled
    # paths ask for them explicitly (a backend, eager=False, --compile, or monkeypatch.delenv("HARDWAY_EAGER")).
    # Workers, notebook kernels and the CLI subprocesses the tests start inherit it.
    os.environ.setdefault("HARDWAY_EAGER", "1")


@pytest.fixture(autouse=True, scope="module")
def give_memory_back_after_each_module():
    """A test module's models should be freed when its fixtures end. Two things kept them: FastAPI's caches of
    route handlers (lru_caches keyed by the handler, in fastapi.dependencies.models), which hold every app a module
    served in-process, with its engine and model; and glibc, which keeps freed pages in the process. Two workers
    holding them all along, beside the notebook kernels, outgrew a 24 GB machine and swapped."""
    yield
    routes = sys.modules.get("fastapi.dependencies.models")
    for cached in vars(routes).values() if routes else ():
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
