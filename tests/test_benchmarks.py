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
