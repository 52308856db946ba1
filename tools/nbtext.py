"""Convert a notebook to and from a plain-text "percent" script, for editing notebooks as text.

    python tools/nbtext.py to-py notebooks/01_safetensors.ipynb /tmp/01.py
    python tools/nbtext.py to-ipynb /tmp/01.py notebooks/01_safetensors.ipynb

In the script, `# %%` starts a code cell and `# %% [markdown]` a markdown cell whose lines start with `# `.
Then run `python tools/export.py` to re-export `hardway/` and strip outputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import clean_notebook, dump_notebook  # noqa: E402


def to_py(nb: dict) -> str:
    parts = []
    for cell in nb["cells"]:
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            body = "\n".join(("# " + l) if l else "#" for l in src.split("\n"))
            parts.append("# %% [markdown]\n" + body)
        else:
            parts.append("# %%\n" + src)
    return "\n\n".join(parts) + "\n"


def to_ipynb(text: str) -> dict:
    cells = []
    chunks = text.split("# %%")
    for chunk in chunks[1:]:
        head, _, body = chunk.partition("\n")
        body = body.strip("\n")
        if head.strip() == "[markdown]":
            lines = [l[2:] if l.startswith("# ") else l.lstrip("#") for l in body.split("\n")]
            cell = {"cell_type": "markdown", "metadata": {}, "source": "\n".join(lines)}
        else:
            cell = {"cell_type": "code", "metadata": {}, "source": body, "outputs": [], "execution_count": None}
        src = cell["source"].split("\n")
        cell["source"] = [l + "\n" for l in src[:-1]] + [src[-1]]
        cells.append(cell)
    return clean_notebook({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 4})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in ("to-py", "to-ipynb"):
        print(__doc__.strip(), file=sys.stdout if args in ([], ["-h"], ["--help"]) else sys.stderr)
        return 0 if args in (["-h"], ["--help"]) else 2
    cmd, src, dst = args
    if cmd == "to-py":
        Path(dst).write_text(to_py(json.loads(Path(src).read_text(encoding="utf-8"))), encoding="utf-8")
    else:
        Path(dst).write_text(dump_notebook(to_ipynb(Path(src).read_text(encoding="utf-8"))), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
