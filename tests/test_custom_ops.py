"""The package's torch operators (hardway::c_matvec_int8, hardway::c_matvec_int4, hardway::onednn_linear) stay right
when their definitions run a second time in the same process, as they do in lesson 22: its cells define the operators
while the package's copy of the same cells is already imported. torch then frees the first registration, and a
Python object kept from it points at freed memory; the package calls its operators by name (torch.ops.hardway.*),
so it always reaches the registration alive now. Before that rule, lesson 22 failed now and then with a dead kernel,
`basic_string::_M_create` or a fake-tensor error, depending on what the freed memory held.

A use-after-free does not fail on every run, so the rule itself is checked first, on the package's source; the tests
after it run the package's paths after a second definition and check the numbers."""
import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hardway.kernels.c_loops as c_loops
import hardway.kernels.onednn as onednn
from hardway.kernels.quantized import QuantizedLinear

PACKAGE = Path(c_loops.__file__).resolve().parents[1]


def custom_op_names(tree: ast.Module) -> set[str]:
    """The Python names that `@library.custom_op(...)` (or `@torch.library.custom_op(...)`) decorates in a module."""
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "custom_op"
                    for d in node.decorator_list)}


def test_the_package_calls_its_operators_by_name():
    """No module calls a custom operator through a Python object (its own, or one imported from another module):
    only torch.ops.<namespace>.<name>(...), looked up at the call."""
    trees = {path: ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}
    names = set().union(*map(custom_op_names, trees.values()))
    assert {"c_matvec_int8", "c_matvec_int4", "onednn_linear"} <= names  # the rule has something to check
    held = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
                held.append(f"{path.relative_to(PACKAGE)}:{node.lineno} calls {node.func.id}(...)")
            if isinstance(node, ast.ImportFrom) and any(alias.name in names for alias in node.names):
                held.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports an operator object")
    assert not held, "call these through torch.ops.hardway instead: " + "; ".join(held)


def define_again(module):
    """Run a module's source once more in a namespace of its own, as a notebook that exports it does."""
    namespace = {"__name__": f"{module.__name__}_again"}
    exec(compile(Path(module.__file__).read_text(), module.__file__, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def defined_twice():
    """The C loops' and oneDNN's operators registered a second time: every object taken from the first definition
    (the modules' own, the ones quantized.py imported) is now stale."""
    for _ in range(3):  # the lesson runs such cells more than once; each time the freed memory may be reused
        again = define_again(c_loops), define_again(onednn)
    return again


@pytest.mark.skipif(not c_loops.c_loops_available(), reason="no C compiler with OpenMP and _Float16 here")
@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, 32)])
def test_the_c_loops_compute_after_their_operators_are_defined_again(defined_twice, bits, group):
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(192, 320, bias=False), bits, group).use_c_loop()
    x = torch.randn(50, 1, 192)
    for row in x:  # (1, 192): one decoded token, the C loop's case; many calls, so a freed entry would be hit
        expected = F.linear(row, layer.dequantized_weight())  # (1, 320)
        torch.testing.assert_close(layer(row), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_onednn_linear_compiles_and_computes_after_it_is_defined_again(defined_twice):
    torch._dynamo.reset()
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = onednn.OneDNNLinear(linear)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # traces packed_product's custom op
    for _ in range(20):
        x = torch.randn(4, 64)  # (4, 64): several rows, the packed path
        torch.testing.assert_close(compiled(x), linear(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-4, atol=1e-5)
