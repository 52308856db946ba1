"""Run many short commands as children forked from one process that imported the heavy libraries once.

Starting Python and importing torch and transformers costs seconds per process on two cores; a command that fails
on its arguments is over in less. `run_forked` imports the shared libraries in one process, then forks a child per
command: each child has its own stdout, stderr and exit code, and sees nothing another child loaded. Where there is
no fork, each command runs in a process of its own, as it would from a shell."""

import json
import os
import subprocess
import sys
from pathlib import Path

# Run as `python -c RUNNER JOBS_FILE`: one [returncode, stdout, stderr] per job, as JSON, beside JOBS_FILE.
RUNNER = r"""
import importlib, json, os, runpy, sys
from pathlib import Path

jobs_file = Path(sys.argv[1])
jobs = json.loads(jobs_file.read_text())
for module in jobs["preload"]:
    importlib.import_module(module)
for i, (target, argv) in enumerate(jobs["commands"]):
    stdout, stderr = jobs_file.with_name(f"{i}.out"), jobs_file.with_name(f"{i}.err")
    pid = os.fork()
    if pid == 0:  # the child: the command, as far as it can tell, run from a shell
        code = 1
        try:
            with open(stdout, "w") as out, open(stderr, "w") as err:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            sys.argv = [target, *argv]
            try:
                if target.endswith(".py"):  # a script
                    sys.path.insert(0, str(Path(target).parent))
                    runpy.run_path(target, run_name="__main__")
                    code = 0
                else:  # "module:function", called with the arguments as a console script would be
                    module, _, name = target.partition(":")
                    code = getattr(importlib.import_module(module), name)(argv) or 0
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
    jobs_file.with_name(f"{i}.json").write_text(json.dumps(result))
"""


def alone(target: str, argv: list) -> list[str]:
    """The command line that runs one target in a process of its own."""
    if target.endswith(".py"):
        return [sys.executable, target, *map(str, argv)]
    module, _, name = target.partition(":")
    return [sys.executable, "-c", f"import sys; from {module} import {name}; sys.exit({name}(sys.argv[1:]))",
            *map(str, argv)]


def run_forked(commands: list[tuple[str, list]], preload: list[str], folder: Path, cwd: Path,
               env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """One CompletedProcess per (target, argv): target is a script's path or "module:function" (a console script's
    entry point, called with the argument list)."""
    if not hasattr(os, "fork"):
        return [subprocess.run(alone(target, argv), cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
                for target, argv in commands]
    jobs = folder / "jobs.json"
    jobs.write_text(json.dumps({"preload": preload, "commands": [[t, list(map(str, a))] for t, a in commands]}))
    runner = subprocess.run([sys.executable, "-c", RUNNER, str(jobs)], cwd=cwd, capture_output=True, text=True,
                            timeout=1200, env=env)
    assert runner.returncode == 0, runner.stderr[-3000:]
    results = []
    for i, (target, argv) in enumerate(commands):
        code, out, err = json.loads((folder / f"{i}.json").read_text())
        results.append(subprocess.CompletedProcess([target, *argv], code, out, err))
    return results
