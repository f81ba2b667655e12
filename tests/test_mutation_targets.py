"""bench/mutation.py's module map and mutant generator (the mutation run itself is not in CI).

Every mapped module and test file exists and the module imports under the name the tool gives
it, so that code moved by another change fails here until the map follows; each mutant changes
exactly one thing, compiles, and keeps every line where it was."""

from __future__ import annotations

import importlib
from pathlib import Path

import mutation
import pytest

ROOT = Path(__file__).resolve().parent.parent

SOURCE = '''
def f(a, b, items):
    """Docstring: never mutated."""
    total = a + b * 2
    if a < b and not items:
        raise ValueError(f"a={a} must be >= {b}")
    for item in items:
        if item is None:
            continue
        total -= item
    return total >= 0
'''


@pytest.mark.parametrize("path", sorted(mutation.TARGETS))
def test_every_mapped_module_and_test_exists(path):
    target = mutation.TARGETS[path]
    assert (ROOT / path).is_file(), f"{path} moved: update bench/mutation.py TARGETS"
    for test in target.tests:
        assert (ROOT / test.split("::")[0]).is_file(), f"{test} moved: update TARGETS"
    module = importlib.import_module(mutation.module_name(path))
    assert Path(module.__file__).resolve() == (ROOT / path).resolve()
    source = (ROOT / path).read_text()
    mutants = mutation.find_mutants(path, source, target.functions)
    assert mutants, f"{path}: no mutants (functions {target.functions} renamed?)"
    if target.functions:
        names = {n for n in target.functions}
        defined = {line.split("(")[0].split()[-1] for line in source.splitlines()
                   if line.lstrip().startswith("def ")}
        assert names <= defined, f"{path}: {sorted(names - defined)} not defined"


def test_mutants_change_one_thing_and_keep_the_lines():
    mutants = mutation.find_mutants("example.py", SOURCE)
    descriptions = {(m.line, m.kind, m.description) for m in mutants}
    assert {(4, "operator", "+ -> -"), (4, "operator", "* -> +"), (4, "constant", "2 -> 3"),
            (5, "operator", "< -> <="), (5, "operator", "and -> or"),
            (5, "operator", "not dropped"), (8, "operator", "is -> is not"),
            (9, "statement", "Continue -> pass"), (10, "operator", "-= -> +="),
            (10, "statement", "AugAssign -> pass"), (11, "operator", ">= -> >"),
            (11, "constant", "0 -> 1")} <= descriptions
    # The docstring, the raise and its message are never touched.
    assert not any(m.line in (3, 6) for m in mutants)
    lines = SOURCE.count("\n")
    for mutant in mutants:
        text = mutation.mutated_source(SOURCE, mutant)
        compile(text, "example.py", "exec")
        assert text.count("\n") == lines and text != SOURCE, mutant
        changed = [i for i, (a, b) in enumerate(zip(SOURCE.splitlines(), text.splitlines()))
                   if a != b]
        assert changed == [mutant.line - 1], mutant


def test_functions_limit_what_is_mutated():
    mutants = mutation.find_mutants("example.py", SOURCE + "\ndef g():\n    return 1 + 1\n",
                                    functions=("g",))
    assert {m.line for m in mutants} == {14}
