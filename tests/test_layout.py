"""The package's layout keeps its rules (docs/layout.md): which way imports go, and how long a module grows."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hardway"
LONG_MODULES = {"text/bpe.py": 560}  # one concept: both BPE tokenizers share the merge loop and the byte table
MAX_LINES = 450


def modules():
    """{dotted name under hardway: set of hardway modules it imports}, exercises left out (they import anything)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "exercises":
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hardway."):
                imported.add(node.module[len("hardway."):])
            elif isinstance(node, ast.Import):
                imported |= {a.name[len("hardway."):] for a in node.names if a.name.startswith("hardway.")}
        out[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = imported
    return out


def test_no_production_module_imports_an_instrument():
    offenders = {m: sorted(i for i in imported if i.startswith("instruments"))
                 for m, imported in modules().items() if not m.startswith("instruments")}
    assert not {m: i for m, i in offenders.items() if i}, offenders


def test_imports_go_one_way_engine_below_server_below_cli():
    graph = modules()
    for m, imported in graph.items():
        top = m.split(".")[0]
        if top not in ("server", "cli"):
            assert not any(i.startswith("server") for i in imported), (m, imported)
        if top != "cli":
            assert "cli" not in imported, (m, imported)
        if top in ("formats", "text", "models", "decode", "kernels"):
            assert not any(i.startswith("engine") for i in imported), (m, imported)


def test_no_module_grows_past_its_length():
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
               for p in PACKAGE.rglob("*.py") if "exercises" not in p.parts}
    too_long = {rel: n for rel, n in lengths.items() if n > LONG_MODULES.get(rel, MAX_LINES)}
    assert not too_long, too_long
    assert all(lengths[rel] > MAX_LINES for rel in LONG_MODULES), "an allowance no module needs any more: drop it"
