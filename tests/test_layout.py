"""The package's layout keeps its rules (docs/layout.md): which way imports go, and how long a module grows.

An import is any way one module reaches another: `import`/`from ... import` anywhere in the file (inside a function
too), and any string that names a hardway module ("hardway.models.llama:Llama" in the model table,
`importlib.import_module("hardway.x")`): a name reached by a string is a dependency all the same."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hardway"
LONG_MODULES = {"text/bpe.py": 560}  # one concept: both BPE tokenizers share the merge loop and the byte table
MAX_LINES = 450
MODULE_NAME = re.compile(r"hardway(?:\.[a-z_][a-z0-9_]*)+")

# The layers, bottom first (docs/layout.md): a module imports from its own layer or the ones below, never above.
LAYERS = [
    {"errors"},
    {"contract", "formats", "text"},  # the model contract, files on disk, text and tokens
    {"models"},
    {"kernels"},
    {"loading"},                      # the loader: a name made a model, its tokenizer, its chat template
    {"decode"},
    {"engine", "verify", "instruments", "tensor_parallel", "course"},
    {"server", "chat_cli"},
    {"cli"},
    {"__init__"},
]


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def module_names() -> set[str]:
    return {".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
            for p in PACKAGE.rglob("*.py")}


def modules():
    """{dotted name under hardway: set of hardway modules it reaches}, exercises left out (they import anything)."""
    known = module_names()
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "exercises":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)  # prose about a module is not a dependency on it
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        type_only = {id(n) for block in ast.walk(tree)  # `if TYPE_CHECKING:` imports name types for annotations only
                     if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
                     for n in ast.walk(block)}
        reached = set()
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hardway"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # `from hardway import cli`
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                names = MODULE_NAME.findall(node.value)
            for name in names:
                parts = name.split(".")
                # the longest prefix that is a module: "hardway.models.llama.Llama" -> models.llama
                for n in range(len(parts), 1, -1):
                    candidate = ".".join(parts[1:n])
                    if candidate in known:
                        reached.add(candidate)
                        break
        me = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out[me] = reached - {me}
    return out


def test_strings_that_name_modules_are_read_as_imports():
    graph = modules()
    assert {"models.gpt2", "models.llama", "models.moe"} <= graph["loading"]  # the model table's "module:class"
    assert MODULE_NAME.findall('"hardway.models.llama:Llama"') == ["hardway.models.llama"]


def test_no_production_module_imports_an_instrument():
    offenders = {m: sorted(i for i in imported if i.startswith("instruments"))
                 for m, imported in modules().items() if not m.startswith("instruments")}
    assert not {m: i for m, i in offenders.items() if i}, offenders


def upward_imports(graph) -> dict:
    """{module: the modules of a higher layer it reaches}, for the modules that reach one."""
    upward = {m: sorted(i for i in imported if layer_of(i) > layer_of(m)) for m, imported in graph.items()}
    return {m: i for m, i in upward.items() if i}


def a_cycle(graph) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state = {}  # module -> "open" while its imports are walked, "done" after

    def walk(m, path):
        state[m] = "open"
        for i in sorted(graph.get(m, ())):
            if state.get(i) == "open":
                return path[path.index(i):] + [i]
            if i not in state and (cycle := walk(i, path + [i])):
                return cycle
        state[m] = "done"
        return None

    return next((c for m in sorted(graph) if m not in state and (c := walk(m, [m]))), None)


def test_imports_go_down_the_layers():
    upward = upward_imports(modules())
    assert not upward, f"imports from a higher layer (docs/layout.md): {upward}"


def test_no_import_cycles():
    cycle = a_cycle(modules())
    assert cycle is None, f"an import cycle: {' -> '.join(cycle)}"


def test_the_rules_catch_what_they_forbid():
    """The checks themselves, on planted graphs: a model that reaches the decode loop or the loader, a tokenizer
    reader and a file format that reach each other (one layer: only the cycle check sees it)."""
    assert upward_imports({"models.llama": {"decode.kv_cache", "errors"}}) == {"models.llama": ["decode.kv_cache"]}
    assert upward_imports({"models.gpt2": {"loading"}, "loading": {"models.gpt2"}}) == {"models.gpt2": ["loading"]}
    assert upward_imports({"text.tokenizer": {"formats.gguf"}, "formats.gguf": {"text.tokenizer"}}) == {}
    assert a_cycle({"text.tokenizer": {"formats.gguf"}, "formats.gguf": {"text.bpe", "text.tokenizer"}}) == \
        ["formats.gguf", "text.tokenizer", "formats.gguf"]
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_every_module_has_a_layer():
    assert all(isinstance(layer_of(m), int) for m in modules())


def test_no_module_grows_past_its_length():
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
               for p in PACKAGE.rglob("*.py") if "exercises" not in p.parts}
    too_long = {rel: n for rel, n in lengths.items() if n > LONG_MODULES.get(rel, MAX_LINES)}
    assert not too_long, too_long
    assert all(lengths[rel] > MAX_LINES for rel in LONG_MODULES), "an allowance no module needs any more: drop it"
