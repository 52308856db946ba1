"""The reference solutions of the lessons' exercises (solutions/NN_<lesson>.py), loaded by file name: the folder is
not a package, and its names start with digits."""

import importlib.util
from pathlib import Path

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def load_solutions(lesson: str):
    """The module solutions/<lesson>.py, e.g. load_solutions("08_kv_cache")."""
    path = SOLUTIONS / f"{lesson}.py"
    spec = importlib.util.spec_from_file_location(f"solutions_{lesson}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
