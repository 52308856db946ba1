"""The notebooks are the source of `hardway/`, and they are committed unrun."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found"


def test_notebooks_are_committed_without_outputs():
    dirty = []
    for nb in NOTEBOOKS:
        for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
                dirty.append(f"{nb.name} cell {i}")
    assert not dirty, f"notebooks with outputs or execution counts (run `uv run python tools/export.py`): {dirty}"


def test_notebook_names_are_numbered_lessons():
    for nb in NOTEBOOKS:
        prefix, _, slug = nb.stem.partition("_")
        assert prefix.isdigit() and len(prefix) == 2 and slug, f"{nb.name} is not named NN_slug.ipynb"


def test_hardway_is_in_sync_with_the_notebooks():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "export.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, "hardway/ or notebooks out of sync; run `uv run python tools/export.py`:\n" + result.stdout
