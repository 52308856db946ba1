"""Every benchmark script imports what it needs from hardway: `--help` runs its imports and its argument parser.

One Python process imports torch and transformers once (most of a script's start-up time); each script then runs as
`script --help` in a child forked from it, so no script sees a hardway module, a sys.path entry or anything else that
another script loaded. Where there is no fork, each script runs in a process of its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

# Run as `python -c RUNNER OUT_DIR SCRIPT...`: one (returncode, stdout, stderr) per script, as JSON, in OUT_DIR.
RUNNER = r"""
import json, os, runpy, sys
from pathlib import Path

import torch, transformers  # the third-party imports every script shares; hardway is left to each script

out_dir = Path(sys.argv[1])
for i, script in enumerate(sys.argv[2:]):
    stdout, stderr = out_dir / f"{i}.out", out_dir / f"{i}.err"
    pid = os.fork()
    if pid == 0:  # the child: `python SCRIPT --help`, as far as the script can tell
        code = 1
        try:
            with open(stdout, "w") as out, open(stderr, "w") as err:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            sys.argv = [script, "--help"]
            sys.path.insert(0, str(Path(script).parent))
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    result = [os.waitstatus_to_exitcode(status), stdout.read_text(), stderr.read_text()]
    (out_dir / f"{i}.json").write_text(json.dumps(result))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """`SCRIPT --help` of every script: its return code, stdout and stderr."""
    if not hasattr(os, "fork"):
        return {s.name: subprocess.run([sys.executable, str(s), "--help"], cwd=ROOT, capture_output=True, text=True,
                                       timeout=300) for s in SCRIPTS}
    out_dir = tmp_path_factory.mktemp("help")
    runner = subprocess.run([sys.executable, "-c", RUNNER, str(out_dir), *map(str, SCRIPTS)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert runner.returncode == 0, runner.stderr[-3000:]
    runs = {}
    for i, script in enumerate(SCRIPTS):
        code, out, err = json.loads((out_dir / f"{i}.json").read_text())
        runs[script.name] = subprocess.CompletedProcess([script.name, "--help"], code, out, err)
    return runs


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_benchmark_script_starts(script, runs):
    run = runs[script.name]
    assert run.returncode == 0, f"{script.name} --help failed:\n{run.stderr[-2000:]}"
    assert "usage:" in run.stdout
