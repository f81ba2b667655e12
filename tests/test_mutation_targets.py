"""bench/mutation.py's module map and mutant generator (the mutation run itself is not in CI).

Every mapped module and test file exists and the module imports under the name the tool gives
it, so that code moved by another change fails here until the map follows; each mutant changes
exactly one thing, compiles, and keeps every line where it was."""

from __future__ import annotations

import importlib
import json
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


def test_a_rerun_finds_the_survivors_by_line_column_and_mutation():
    mutants = mutation.find_mutants("example.py", SOURCE)
    plus = next(m for m in mutants if m.description == "+ -> -")
    times = next(m for m in mutants if m.description == "* -> +")
    assert plus.line == times.line == 4 and plus.begin - plus.line_offset == 14
    survivors = [{"line": 4, "column": 14, "mutation": "operator + -> -"},
                 {"line": 4, "column": None, "mutation": "operator * -> +"},
                 {"line": 4, "column": 13, "mutation": "operator * -> +"}]
    assert mutation.select_survivors(mutants, survivors) == [plus, times]
    assert mutation.select_survivors(mutants, survivors[2:]) == []


def test_a_rerun_scores_the_same_mutants_again_and_keeps_the_earlier_score():
    first = {"line": 4, "column": 13, "mutation": "operator + -> -", "verdict": "survived"}
    second = {"line": 9, "column": 12, "mutation": "statement Continue -> pass",
              "verdict": "not covered"}
    before = {"module": "example.py", "run": 10, "killed": 7, "timeout": 1, "survived": 1,
              "not covered": 1, "score": 0.8, "survivors": [first, second],
              "tests": ["old.py"], "keyword": None}
    rerun = {"tests": ["old.py", "new.py"], "keyword": None,
             "verdicts": [dict(first, verdict="killed", detail="FAILED new.py::test"),
                          dict(second, verdict="survived", detail="")]}
    merged = mutation.merge_rerun(before, rerun)
    assert (merged["killed"], merged["timeout"], merged["survived"], merged["not covered"],
            merged["score"], merged["run"]) == (8, 1, 1, 0, 0.9, 10)
    assert merged["before"] == {"score": 0.8, "run": 10, "survived": 1, "not covered": 1}
    assert merged["survivors"] == [dict(second, verdict="survived")]
    assert merged["killed_since"] == [dict(first, verdict="killed",
                                           detail="FAILED new.py::test")]
    assert merged["tests"] == ["old.py", "new.py"]
    unchanged = mutation.merge_rerun(before, None)
    assert unchanged["score"] == 0.8 and unchanged["before"]["score"] == 0.8


def test_reports_of_different_modules_combine_and_a_module_twice_is_refused():
    one = {"modules": [{"module": "a.py"}], "command": "c1", "git_revision": "r1",
           "date": "d", "sample": 20, "seed": 0}
    two = dict(one, modules=[{"module": "b.py"}], command="c2", sample=10)
    combined = mutation.combine_reports([one, two])
    assert [m["module"] for m in combined["modules"]] == ["a.py", "b.py"]
    assert [r["command"] for r in combined["runs"]] == ["c1", "c2"]
    assert combined["sample"] == [10, 20]
    joined = dict(one, modules=[{"module": "c.py"}], runs=[{"command": "c3"}, {"command": "c4"}])
    assert [r["command"] for r in mutation.combine_reports([one, joined])["runs"]] == \
        ["c1", "c3", "c4"]
    assert mutation.combine_reports([one, dict(joined, sample=[10, 20])])["sample"] == [10, 20]
    with pytest.raises(SystemExit, match="several reports"):
        mutation.combine_reports([one, one])


def test_the_worker_writes_what_it_measured_after_each_mutant(monkeypatch, tmp_path):
    """A run stopped early keeps its finished modules and the current one so far."""
    import signal

    seen = []

    def fake_run_module(path, target, *, progress, **kwargs):
        partial = {"module": path, "run": 1, "complete": False}
        progress(partial)
        seen.append(json.loads(out.read_text()))
        return dict(partial, run=2, complete=True)

    out = tmp_path / "part.json"
    monkeypatch.setattr(mutation, "run_module", fake_run_module)
    monkeypatch.setattr(mutation, "_warm_imports", lambda interpreter: None)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert mutation.main(["--worker", "--modules", "engine/sampling.py",
                              "context/prefix_cache.py", "--out", str(out)]) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert seen == [[{"module": "engine/sampling.py", "run": 1, "complete": False}],
                    [{"module": "engine/sampling.py", "run": 2, "complete": True},
                     {"module": "context/prefix_cache.py", "run": 1, "complete": False}]]
    assert [m["run"] for m in json.loads(out.read_text())] == [2, 2]


def test_join_writes_separate_runs_as_one_report_and_runs_nothing(tmp_path):
    parts = []
    for number, module in enumerate(["a.py", "b.py"]):
        part = tmp_path / f"{number}.json"
        part.write_text(json.dumps({
            "modules": [{"module": module, "mutants": 9, "run": 2, "killed": 2, "timeout": 0,
                         "survived": 0, "not covered": 0, "score": 1.0}],
            "command": f"run {module}", "git_revision": "abc", "date": "d", "sample": 20,
            "seed": 0}))
        parts.append(str(part))
    out = tmp_path / "joined.json"
    assert mutation.main(["--join", *parts, "--out", str(out)]) == 0
    joined = json.loads(out.read_text())
    assert [m["module"] for m in joined["modules"]] == ["a.py", "b.py"]
    assert [r["command"] for r in joined["runs"]] == ["run a.py", "run b.py"]
    assert joined["git_revision"] == ["abc"] and joined["complete"] is True


def test_the_tracer_records_per_test_lines_and_what_runs_outside_the_tests(tmp_path):
    import importlib.util

    from mutation_coverage import PerTestTracer

    module = tmp_path / "traced.py"
    module.write_text("def one():\n    return 1\n\n\ndef two():\n    x = 2\n    return x\n")
    spec = importlib.util.spec_from_file_location("traced_example", module)
    traced = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(traced)
    tracer = PerTestTracer([str(module)])

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    def run_test(nodeid, function):
        hook = tracer.pytest_runtest_protocol(Item(nodeid), None)
        next(hook)
        function()
        with pytest.raises(StopIteration):
            next(hook)

    tracer.start()
    try:
        traced.one()                    # collection time: outside every test
        run_test("t.py::a", traced.two)
        run_test("t.py::b", lambda: None)
    finally:
        tracer.stop()
    recorded = tracer.as_json(tmp_path)
    assert recorded["outside"] == {"traced.py": [2]}
    assert recorded["tests"]["t.py::a"]["lines"] == {"traced.py": [6, 7]}
    assert recorded["tests"]["t.py::b"]["lines"] == {}


def test_a_mutant_runs_the_tests_that_cover_its_line_fastest_first(tmp_path):
    from mutation_coverage import CoverageMap, find_map, map_file, stages

    cover = CoverageMap.empty({"m.py": "hash"}, None, False)
    cover.add(["t1.py"], {"tests": {"t1.py::slow": {"seconds": 3.0, "lines": {"m.py": [5, 6]}},
                                    "t1.py::fast": {"seconds": 0.5, "lines": {"m.py": [6]}}},
                          "outside": {"m.py": [2]}}, 5.0)
    assert cover.missing(["t1.py", "t2.py"]) == ["t2.py"]
    cover.add(["t2.py"], {"tests": {"t2.py::mid": {"seconds": 1.0, "lines": {"m.py": [6, 9]}}},
                          "outside": {}}, 2.0)
    assert cover.covering("m.py", 6) == ["t1.py::fast", "t2.py::mid", "t1.py::slow"]
    assert cover.covering("m.py", 9) == ["t2.py::mid"] and cover.covering("m.py", 7) == []
    assert cover.lines("m.py") == {2, 5, 6, 9}
    assert cover.seconds(["t1.py::slow", "t2.py::mid"]) == 4.0
    assert cover.overhead() == 7.0 - 4.5
    assert stages([str(i) for i in range(10)], first=8) == [[str(i) for i in range(8)],
                                                            ["8", "9"]]
    assert stages(["a"]) == [["a"]]
    # Kept and read again while the traced sources are the same and its tests still mapped.
    cover.save(map_file(tmp_path, ["m.py"], None, False))
    again = find_map(tmp_path, {"m.py": "hash"}, None, False, ["t0.py", "t1.py", "t2.py"])
    assert again.covering("m.py", 6) == cover.covering("m.py", 6)
    assert again.missing(["t0.py", "t1.py", "t2.py"]) == ["t0.py"]
    assert find_map(tmp_path, {"m.py": "other"}, None, False, ["t1.py", "t2.py"]) is None
    assert find_map(tmp_path, {"m.py": "hash"}, None, True, ["t1.py", "t2.py"]) is None
    assert find_map(tmp_path, {"m.py": "hash"}, None, False, ["t1.py"]) is None


def test_a_rerun_leaves_out_the_survivors_contributing_names_equivalent():
    text = ("Equivalent survivors (no test can kill them):\n\n"
            "| module | line | mutation | why |\n|---|---|---|---|\n"
            "| `context/a.py` | 12 | `x` -> `y` | same |\n| `kernels/b.py` | 7 | z | w |\n\n"
            "Open survivors:\n\n| `context/c.py` | 3 | u | v |\n")
    assert mutation.named_equivalent(text) == {("context/a.py", 12), ("kernels/b.py", 7)}
    named = mutation.named_equivalent()
    assert named and all((ROOT / module).is_file() for module, _ in named)
