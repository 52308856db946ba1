"""`hardway --help` and argparse's errors answer before torch is imported: the CLI builds its parser from argparse
and light modules, and each command imports what it runs (start-up under a second)."""

import subprocess
import sys

import pytest

IMPORTS_OF = """
import sys
from hardway.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "numpy", "fastapi", "uvicorn", "transformers") if m in sys.modules)
print("imported:", ",".join(heavy))
"""


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["serve", "--model", "x", "--no-such-flag"], ["verify"]])
def test_help_and_argument_errors_import_no_torch(argv):
    r = subprocess.run([sys.executable, "-c", IMPORTS_OF.format(argv=argv)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "imported:", r.stdout


def test_the_dtype_choices_are_the_loaders_dtypes():
    from hardway.cli import DTYPES
    from hardway.loading import DTYPE_NAMES
    assert sorted(DTYPES) == sorted(DTYPE_NAMES)


def test_hardway_eager_in_the_environment_is_read_once_into_the_config(monkeypatch):
    """HARDWAY_EAGER=1 (old scripts) and --eager both give a config that compiles nothing; the CLI does not write the
    variable into the environment for the library to find."""
    import os

    import hardway.server.launch as launch
    from hardway import cli

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda *args, **kwargs: seen.update(kwargs))
    monkeypatch.delenv("HARDWAY_EAGER", raising=False)
    args = ["serve", "--model", "openai-community/gpt2", "--device", "cpu", "--dtype", "float32"]
    assert cli.main(args) == 0 and seen["config"].compile_sizes == (1, 8, 16)
    assert cli.main(args + ["--eager"]) == 0 and seen["config"].compile_sizes == ()
    assert "HARDWAY_EAGER" not in os.environ
    monkeypatch.setenv("HARDWAY_EAGER", "1")
    assert cli.main(args) == 0 and seen["config"].compile_sizes == ()
    monkeypatch.delenv("HARDWAY_EAGER")
    assert cli.main(args + ["--max-batch", "4"]) == 0 and seen["config"].compile_sizes == (1,)  # sizes up to it
