"""The exercises' package: one verdict helper that every check speaks through, one module per lesson, and a package
that imports nothing itself."""

import importlib
import pkgutil
import subprocess
import sys

import pytest
import torch

import hardway.exercises
from hardway.exercises.verdict import Wrong, attempt, exercise_check, expect_tensor

LESSON_MODULES = sorted(m.name for m in pkgutil.iter_modules(hardway.exercises.__path__) if m.name.startswith("lesson_"))


@exercise_check
def check_double(my_double, answers=()) -> str:
    got = attempt(my_double, 3, when="x=3", answers=answers)
    if got != 6:
        raise Wrong(f"my_double(3) is {got!r}, expected 6")
    return "right: doubles"


@exercise_check(kind="dict")
def check_table(my_table) -> str:
    return "right" if my_table == {} else "wrong: not empty"


def test_a_check_says_not_attempted_for_none_and_for_not_implemented():
    assert check_double(None) == "not attempted yet: set my_double to your function"
    assert check_table(None) == "not attempted yet: set my_table to your dict"

    def not_yet(x):
        raise NotImplementedError

    assert check_double(not_yet) == "not attempted yet: my_double raises NotImplementedError"


def test_a_wrong_answer_or_an_exception_is_one_line_that_names_the_case():
    assert check_double(lambda x: x + 2) == "wrong: my_double(3) is 5, expected 6"
    assert check_double(lambda x: 1 / 0) == "wrong: my_double raised ZeroDivisionError: division by zero (x=3)"
    assert check_double(lambda x: 2 * x) == "right: doubles"


def test_an_exception_the_exercise_asks_for_reaches_the_check():
    def refuses(x):
        raise KeyError("no")

    with pytest.raises(KeyError):
        check_double(refuses, answers=(KeyError,))


def test_expect_tensor_says_what_differs():
    expected = torch.arange(6.0).reshape(2, 3)

    def verdict(got, **kwargs):
        try:
            expect_tensor("x", got, expected, **kwargs)
        except Wrong as e:
            return str(e)
        return None

    assert verdict(expected.clone()) is None
    assert verdict([1, 2]) == "wrong: x should be a tensor of shape (2, 3), got list"
    assert verdict(expected.T) == "wrong: x has shape (3, 2), expected (2, 3)"
    assert verdict(expected.double(), dtype=True) == "wrong: x has dtype torch.float64, expected torch.float32"
    assert verdict(expected.double()) is None
    off = expected.clone()
    off[1, 2] += 0.5
    assert verdict(off, hint="look at the last column") == (
        "wrong: x differs first at index (1, 2) (expected 5, got 5.5); max |Δ| 0.5  (look at the last column)")
    assert verdict(off, atol=1.0) is None


@pytest.mark.parametrize("name", LESSON_MODULES)
def test_every_check_speaks_through_the_helper(name):
    module = importlib.import_module(f"hardway.exercises.{name}")
    checks = [value for key, value in vars(module).items() if key.startswith("check_") and callable(value)]
    assert checks, f"{name} has no checks"
    assert all(hasattr(check, "__wrapped__") for check in checks), f"{name}: a check without @exercise_check"


def test_the_package_imports_nothing_and_every_lesson_has_its_module():
    assert LESSON_MODULES[:13] == [f"lesson_{n:02}" for n in range(1, 14)]
    code = "import sys, hardway.exercises; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
