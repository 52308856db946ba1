"""The notebooks are the source of `hardway/`, and they are committed unrun. Every notebook is a lesson, except the one
that holds the exercises' checks: a lesson shows its exercises and their verdicts, the checks notebook their code."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHECKS = ROOT / "notebooks" / "exercise_checks.ipynb"
LESSONS = [nb for nb in NOTEBOOKS if nb != CHECKS]
EXPORT = re.compile(r"^#\|\s*export\s+(\S+)", re.M)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def exports(cell: dict) -> list[str]:
    return EXPORT.findall(source(cell)) if cell["cell_type"] == "code" else []


def defined_checks(code: str) -> set[str]:
    """The check_ functions a cell defines."""
    code = "\n".join(line for line in code.splitlines() if not line.startswith("#|"))
    return {node.name for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")}


def imported_checks(path: Path, n: int) -> set[str]:
    """The check_ names a lesson imports from its module, hardway.exercises.lesson_NN."""
    names = set()
    for cell in cells(path):
        if cell["cell_type"] == "code" and not source(cell).startswith("%"):  # a magic (%%c_file: C) is not Python
            for node in ast.walk(ast.parse(source(cell))):
                if isinstance(node, ast.ImportFrom) and node.module == f"hardway.exercises.lesson_{n:02}":
                    names |= {a.name for a in node.names if a.name.startswith("check_")}
    return names


def check_sections() -> dict[int, list[dict]]:
    """{lesson number: the cells of its section} in the checks notebook, in the notebook's order."""
    sections, current = {}, None
    for cell in cells(CHECKS):
        m = re.match(r"## Lesson (\d\d) · ", source(cell)) if cell["cell_type"] == "markdown" else None
        if m:
            current = sections.setdefault(int(m.group(1)), [])
        elif cell["cell_type"] == "markdown" and source(cell).startswith("## "):
            current = None  # a section that is not a lesson's: the helper, the closing list
        elif current is not None:
            current.append(cell)
    return sections


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found"


def test_notebooks_are_committed_without_outputs():
    dirty = []
    for nb in NOTEBOOKS:
        for i, cell in enumerate(cells(nb)):
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
                dirty.append(f"{nb.name} cell {i}")
    assert not dirty, f"notebooks with outputs or execution counts (run `uv run python tools/export.py`): {dirty}"


def test_notebook_names_are_numbered_lessons_and_the_checks():
    assert CHECKS in NOTEBOOKS, "notebooks/exercise_checks.ipynb, the exercises' checks, is missing"
    for nb in LESSONS:
        prefix, _, slug = nb.stem.partition("_")
        assert prefix.isdigit() and len(prefix) == 2 and slug, f"{nb.name} is not named NN_slug.ipynb"
    assert [int(nb.name[:2]) for nb in LESSONS] == list(range(1, len(LESSONS) + 1))


def test_no_lesson_holds_its_checks():
    """A lesson shows a verdict, not the answer: no lesson defines a check or writes the checks' helper. (A lesson
    may start its exercise module with what its own cells use, as lesson 11 does with its five bugs.)"""
    found = []
    for nb in LESSONS:
        for i, cell in enumerate(cells(nb)):
            for module in exports(cell):
                if module in ("exercises", "exercises.verdict") or (
                        module.startswith("exercises.") and defined_checks(source(cell))):
                    found.append(f"{nb.name} cell {i}: {module}")
    assert not found, "checks written in a lesson instead of notebooks/exercise_checks.ipynb:\n" + "\n".join(found)


def test_the_checks_notebook_has_every_lesson_in_order_and_writes_only_checks():
    sections = check_sections()
    assert list(sections) == [int(nb.name[:2]) for nb in LESSONS], "one section per lesson, in lesson order"
    headings = [source(c) for c in cells(CHECKS) if c["cell_type"] == "markdown"]
    for nb in LESSONS:
        title = source(cells(nb)[0]).splitlines()[0].removeprefix("# ")  # "01 · Safetensors by hand, ..."
        assert any(h.startswith(f"## Lesson {title}\n") for h in headings), f"no section titled 'Lesson {title}'"
    for n, section in sections.items():
        modules = {m for cell in section for m in exports(cell)}
        assert modules == {f"exercises.lesson_{n:02}"}, (n, modules)
    modules = {m for cell in cells(CHECKS) for m in exports(cell)}
    assert modules == {"exercises", "exercises.verdict"} | {f"exercises.lesson_{n:02}" for n in sections}


def test_every_lesson_has_two_to_four_checks_each_with_its_code_a_test_and_a_solution():
    sections = check_sections()
    for nb in LESSONS:
        n = int(nb.name[:2])
        imported = imported_checks(nb, n)
        assert 2 <= len(imported) <= 4, f"{nb.name} has {len(imported)} exercise checks"
        defined = set().union(*(defined_checks(source(c)) for c in sections[n] if exports(c)))
        assert imported == defined, f"{nb.name}: imports {sorted(imported)}, its section defines {sorted(defined)}"
        test = (ROOT / "tests" / f"test_exercises_{n:02}.py").read_text(encoding="utf-8")
        assert all(name in test for name in imported), f"tests/test_exercises_{n:02}.py misses a check of {nb.name}"
        assert (ROOT / "solutions" / f"{nb.stem}.py").exists(), f"no solutions/{nb.stem}.py"
        text = " ".join(" ".join(source(c).split()) for c in cells(nb) if c["cell_type"] == "markdown")
        assert "`notebooks/exercise_checks.ipynb`" in text and f"lesson {n:02}'s section" in text, nb.name
        assert f"`solutions/{nb.stem}.py`" in text, f"{nb.name} does not point to its solutions"


def test_these_checks_can_fail():
    assert defined_checks("#| export exercises.lesson_99\n@exercise_check\ndef check_x(my_x):\n    return 'right'") == {
        "check_x"}
    assert not defined_checks("#| export exercises.lesson_11\nCAUSES = ['a']\ndef broken(model, cause):\n    pass")


def test_hardway_is_in_sync_with_the_notebooks():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "export.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, "hardway/ or notebooks out of sync; run `uv run python tools/export.py`:\n" + result.stdout
