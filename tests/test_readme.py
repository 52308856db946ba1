"""The documented code runs: every Python block of the README, models/README.md and docs/ is executed against the
stand-ins, and every shell command they show is parsed by the parser of the command it runs.

A Python block that needs something this machine may lack says so on the line before its fence:
`<!-- needs: server -->` (run here against a `hardway serve` of the stand-in, started for it) or
`<!-- needs: gpu -->` (run where CUDA is, reported as a skip with its reason elsewhere).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hardway.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "models" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"<!--\s*needs:\s*(\w+)\s*-->\s*$")
SERVER_URL = "http://127.0.0.1:8000"  # what a `needs: server` block talks to, replaced by the test's server


def blocks(language: str):
    """(page, line number, code, needs) of every fenced block in `language`."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(1) != language:
                continue
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            needs = NEEDS.search(before)
            line = text.count("\n", 0, m.start()) + 1
            yield page.relative_to(ROOT), line, m.group(2), needs.group(1) if needs else None


def block_id(block) -> str:
    return f"{block[0]}:{block[1]}"


PYTHON_BLOCKS = list(blocks("python"))
SHELL_BLOCKS = list(blocks("bash"))


def test_the_readme_shows_code_to_run():
    """The checks below are not empty: the README shows the package in Python and the command line in shell."""
    pages = {str(b[0]) for b in PYTHON_BLOCKS}
    assert "README.md" in pages, "the README has no Python block: the package section should show one"
    assert any(str(b[0]) == "README.md" and "hardway" in b[2] for b in SHELL_BLOCKS)


def run_python(code: str) -> subprocess.CompletedProcess:
    """A block in a fresh interpreter of this environment (the stand-ins through HARDWAY_MODELS, set by conftest)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def served_url():
    """`hardway serve` of the SmolLM2 stand-in, for the blocks that need a server."""
    from test_server import Server  # tests/ is on sys.path under pytest

    server = Server("HuggingFaceTB/SmolLM2-135M-Instruct")
    yield server.url
    server.stop()


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=block_id)
def test_python_block_runs(block, request):
    page, line, code, needs = block
    if needs == "server":
        code = code.replace(SERVER_URL, request.getfixturevalue("served_url"))
    elif needs == "gpu":
        import torch
        if not torch.cuda.is_available():
            pytest.skip(f"{page}:{line} needs a CUDA GPU, and this machine has none")
    else:
        assert needs is None, f"{page}:{line}: unknown marker 'needs: {needs}' (server or gpu)"
    result = run_python(code)
    assert result.returncode == 0, f"{page}:{line} failed:\n{result.stderr[-3000:]}"


def commands(code: str):
    """Each command of a shell block as a list of words: lines joined at a trailing backslash, comments dropped,
    split at line ends, ;, &&, ||, | and &."""
    words = [w for line in code.replace("\\\n", " ").splitlines() for w in shlex.split(line, comments=True) + [";"]]
    command: list[str] = []
    for word in words:
        if word in (";", "&&", "||", "&", "|"):
            if command:
                yield command
            command = []
        elif word.endswith("&") and not word.endswith("\\&"):
            command.append(word[:-1])
            yield command
            command = []
        else:
            command.append(word)


def hardway_args(command: list[str]) -> list[str] | None:
    """The arguments of a `hardway ...` or `uv run hardway ...` command, None for any other command."""
    return command[command.index("hardway") + 1:] if "hardway" in command[:3] else None


def script_and_flags(command: list[str]) -> tuple[str, list[str]] | None:
    """A repository script run by `[uv run] python benchmarks/X.py` or tools/X.py, and the flags given to it."""
    for i, word in enumerate(command):
        if re.fullmatch(r"(benchmarks|tools)/\w+\.py", word) and i > 0 and command[i - 1] == "python":
            return word, [w.split("=", 1)[0] for w in command[i + 1:] if w.startswith("--")]
    return None


HARDWAY_COMMANDS = [(f"{page}:{line}", args) for page, line, code, _ in SHELL_BLOCKS for c in commands(code)
                    if (args := hardway_args(c)) is not None]
SCRIPT_COMMANDS = [(f"{page}:{line}", found) for page, line, code, _ in SHELL_BLOCKS for c in commands(code)
                   if (found := script_and_flags(c)) is not None]


@pytest.mark.parametrize("where,args", HARDWAY_COMMANDS, ids=[f"{w} {a[0]}" for w, a in HARDWAY_COMMANDS])
def test_hardway_command_parses(where, args, capsys):
    """The CLI's own parser takes the command as written: a renamed or removed flag fails here."""
    try:
        build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `hardway {' '.join(args)}` is refused by the parser: {capsys.readouterr().err}")


def test_the_parser_refuses_what_it_should():
    """The check above can fail: a flag the CLI does not have is refused."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "x", "--no-such-flag", "hi"])


HELP: dict[str, str] = {}


@pytest.mark.parametrize("where,found", SCRIPT_COMMANDS, ids=[f"{w} {f[0]}" for w, f in SCRIPT_COMMANDS])
def test_script_flags_exist(where, found):
    """Every flag a documented benchmark or tool command passes is one its --help lists."""
    script, flags = found
    if script not in HELP:
        result = run_python(f"import sys, runpy; sys.argv = [{script!r}, '--help']; "
                            f"runpy.run_path({script!r}, run_name='__main__')")
        assert result.returncode == 0, f"{script} --help failed:\n{result.stderr[-2000:]}"
        HELP[script] = result.stdout
    listed = set(re.findall(r"--[\w-]+", HELP[script]))
    missing = [f for f in flags if f not in listed]
    assert not missing, f"{where}: {script} has no {', '.join(missing)}"
