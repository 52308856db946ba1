"""The course's text: every "lesson NN" names a lesson that exists, nothing points outside the repository, and no
planning or development words reach the learner (the course speaks to its reader, not about how it was made). Read from the notebooks, the README, docs/, the exported package, the solutions and the
benchmarks: everything a learner reads."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LESSONS = {int(p.name[:2]) for p in NOTEBOOKS}
LESSON_REF = re.compile(r"\b[Ll]essons?\s+(\d{1,2})((?:\s*(?:[-–,]|and|or|to)\s*\d{1,2})*)")
OUTSIDE = re.compile(r"\.\./shared|\bshared/reference\b|/work/|\.\./\.library|\.library/")
TIMING_ASSERT = re.compile(r"^\s*assert\b.*(step\[|tok_per_s|tokens_per_s|elapsed|perf_counter|speed|_ms\b|seconds|"
                           r"wall\b|ttft|itl\b)", re.M)
PLANNING = re.compile(r"(?i)course's target|\bthe target is\b|\bspeed target\b|\d(?:\.\d+)?x target|\(target\b(?!=)|"
                      r"\bseed asks\b|\bthe issue\b|\bissue's\b")
# How the course was made, where the reader needs what the machine was or what to run: "In CI", "the course's test
# machine", "the CPU the course is developed on", "No GPU was at hand when this README was written".
DEVELOPMENT = re.compile(r"\bCI\b|(?i:\bcourse is developed\b|\bdevelopment (?:CPU|machine|box)\b|"
                         r"\bcourse's (?:test|CI|development) machine\b|\bso do our measurements\b|"
                         r"\bwhen this (?:README|lesson|notebook) was written\b|\bat hand when\b|"
                         r"\bnot yet been measured\b|\bwe developed\b)")


# A machine the learner does not have, named as if they did: a figure typed in from one run ("on this CPU", "the
# course's 2-core CPU") reads as a promise about theirs. A lesson says "the cell above measured", or names the machine
# of a run it cites (docs/ name theirs: they record runs, so they are not read here).
MACHINE = re.compile(r"(?i)\bthis CPU\b|\bthe course's (?:\d-core )?(?:CPU|machine|computer|VM)\b|\bour (?:CPU|machine)\b|"
                     r"\b\d-core CPU like\b|\bwhile other work shared the machine\b")

def texts():
    """(where, text) for every cell of every notebook and every text file a learner reads."""
    for path in [*NOTEBOOKS, ROOT / "notebooks" / "exercise_checks.ipynb"]:  # the lessons, and their checks
        for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            yield f"{path.name} cell {i}", "".join(cell["source"])
    for pattern in ("README.md", "models/README.md", "docs/*.md", "hardway/**/*.py", "solutions/*.py", "benchmarks/*.py", "tools/*.py"):
        for path in sorted(ROOT.glob(pattern)):
            yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")


def lesson_numbers(match: re.Match) -> list[int]:
    numbers = [int(match.group(1))] + [int(n) for n in re.findall(r"\d{1,2}", match.group(2))]
    if re.search(r"[-–]|to", match.group(2)) and len(numbers) == 2:  # a range: lessons 03-06
        numbers = list(range(numbers[0], numbers[1] + 1))
    return numbers


def test_there_are_lessons():
    assert len(LESSONS) >= 14 and min(LESSONS) == 1


def test_every_lesson_reference_names_an_existing_lesson():
    wrong = [f"{where}: {m.group(0)!r}" for where, text in texts() for m in LESSON_REF.finditer(text)
             if any(n not in LESSONS for n in lesson_numbers(m))]
    assert not wrong, "references to lessons that do not exist:\n" + "\n".join(wrong)


def test_nothing_points_outside_the_repository():
    found = [f"{where}: {m.group(0)!r}" for where, text in texts() for m in OUTSIDE.finditer(text)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_no_planning_words_reach_the_learner():
    found = [f"{where}: ...{text[max(0, m.start() - 40):m.end() + 20]!r}..." for where, text in texts()
             for m in PLANNING.finditer(text)]
    assert not found, "planning words in the course:\n" + "\n".join(found)


def test_no_development_words_reach_the_learner():
    found = [f"{where}: ...{text[max(0, m.start() - 40):m.end() + 20]!r}..." for where, text in texts()
             for m in DEVELOPMENT.finditer(text)]
    assert not found, "words about the course's development:\n" + "\n".join(found)


def test_no_lesson_speaks_of_a_machine_the_learner_does_not_have():
    found = [f"{where}: ...{text[max(0, m.start() - 60):m.end() + 30]!r}..." for where, text in texts()
             if not where.startswith("docs/") for m in MACHINE.finditer(text)]
    assert not found, "a machine named as the learner's:\n" + "\n".join(found)


def test_no_notebook_asserts_a_timing():
    """A timing depends on the machine and on what else it runs: a lesson prints and plots it, and the benchmarks
    judge speed, so that a lesson runs top to bottom on any machine."""
    found = [f"{where}: {m.group(0).strip()[:100]!r}" for where, text in texts() if ".ipynb cell " in where
             for m in TIMING_ASSERT.finditer(text)]
    assert not found, "asserts on timings:\n" + "\n".join(found)


@pytest.mark.parametrize("text, numbers", [("lesson 04", [4]), ("lessons 03-06", [3, 4, 5, 6]),
                                           ("Lessons 05 and 06", [5, 6]), ("lessons 11–12", [11, 12])])
def test_lesson_references_are_read_as_a_learner_reads_them(text, numbers):
    assert lesson_numbers(LESSON_REF.search(text)) == numbers


def test_the_checks_catch_what_they_look_for():
    assert [lesson_numbers(m) for m in LESSON_REF.finditer("see lesson 15 and lessons 13-16")] == [[15], [13, 14, 15, 16]]
    assert OUTSIDE.search("open ../shared/reference/matching-transformers.md")
    assert PLANNING.search("the course's target is 1.3x") and PLANNING.search("as the seed asks")
    assert not PLANNING.search("torch.manual_seed(0); targets = ids[:, 1:]")
    for phrase in ("In CI there is no network", "(as in CI)", "the course's test machine has 2 cores; so do our "
                   "measurements", "On the 2-core CPU the course is developed on", "On the 2-core development CPU",
                   "No GPU was at hand when this README was written", "but has not yet been measured on a GPU"):
        assert DEVELOPMENT.search(phrase), phrase
    assert not DEVELOPMENT.search("Measured on a 2-core CPU (AMD EPYC), 72.7 GB/s; the decision is a CIrcle")
    assert TIMING_ASSERT.search("x = 1\nassert step[16] < 16 * step[1]") and TIMING_ASSERT.search("  assert speedup > 1.5")
    assert not TIMING_ASSERT.search("print(f'{speedup:.1f}x')\nassert torch.equal(a, b)")
    for phrase in ("1.5x to 1.6x fp32's speed on this CPU", "on the course's 2-core CPU, measured on one thread while "
                   "other work shared the machine", "On a 2-core CPU like the one of the README's table"):
        assert MACHINE.search(phrase), phrase
    assert not MACHINE.search("the cell above measured 1.5x on your CPU; docs/performance.md: a 2-core AMD EPYC")
