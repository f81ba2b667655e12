"""Per-test coverage for ``bench/mutation.py``: which tests execute which lines of the mutated
modules, and how long each test takes, from one traced run of the tests unmutated. A mutant then
runs only the tests that execute its line, fastest first, instead of every mapped test file.

The map of one run (``CoverageMap.as_json``) can be kept (``--coverage-dir``) and read again by a
later run of the same checkout: only the test files it lacks (new tests) are traced then, so a
``--rerun`` after adding tests costs the new tests' run and the survivors' covering tests. The map
names the sha256 of every traced module; a module whose source changed makes the map stale, and
it is traced again from scratch."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

import pytest

FIRST_STAGE = 8   # the fastest covering tests, run first in a fork of their own


class PerTestTracer:
    """A pytest plugin with a ``sys.settrace`` tracer: per test (setup, call and teardown) the
    lines of ``files`` it executes and its seconds; lines executed outside every test (while
    collecting) go to ``outside``."""

    def __init__(self, files: Sequence[str]):
        self.outside: Dict[str, Set[int]] = {str(f): set() for f in files}
        self.current = self.outside
        self.tests: Dict[str, dict] = {}

    def _local(self, frame, event, arg):
        if event == "line":
            self.current[frame.f_code.co_filename].add(frame.f_lineno)
        return self._local

    def tracer(self, frame, event, arg):
        if frame.f_code.co_filename in self.outside:   # a call: its lines follow
            return self._local
        return None

    def start(self) -> None:
        sys.settrace(self.tracer)
        threading.settrace(self.tracer)

    def stop(self) -> None:
        sys.settrace(None)
        threading.settrace(None)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        lines = {name: set() for name in self.outside}
        self.current, start = lines, time.perf_counter()
        yield
        self.current = self.outside
        self.tests[item.nodeid] = {"seconds": time.perf_counter() - start, "lines": lines}

    def as_json(self, root: Path) -> dict:
        def relative(lines: Dict[str, Set[int]]) -> Dict[str, List[int]]:
            return {Path(name).relative_to(root).as_posix(): sorted(found)
                    for name, found in lines.items() if found}

        return {"tests": {nodeid: {"seconds": round(test["seconds"], 3),
                                   "lines": relative(test["lines"])}
                          for nodeid, test in self.tests.items()},
                "outside": relative(self.outside)}


def source_hashes(root: Path, paths: Sequence[str]) -> Dict[str, str]:
    return {path: hashlib.sha256((root / path).read_bytes()).hexdigest() for path in paths}


class CoverageMap:
    """The traced runs of one group of modules (same tests, keyword and interpreter setting)."""

    def __init__(self, data: dict):
        self.data = data

    @classmethod
    def empty(cls, sources: Dict[str, str], keyword: Optional[str],
              interpreter: bool) -> "CoverageMap":
        return cls({"sources": sources, "keyword": keyword, "interpreter": interpreter,
                    "test_args": [], "tests": {},
                    "outside": {}, "seconds": 0.0})

    def add(self, test_args: Sequence[str], traced: dict, seconds: float) -> None:
        """Merge one traced run of ``test_args`` (``PerTestTracer.as_json``)."""
        self.data["test_args"] += [t for t in test_args if t not in self.data["test_args"]]
        self.data["tests"].update(traced["tests"])
        for path, lines in traced["outside"].items():
            self.data["outside"][path] = sorted(set(self.data["outside"].get(path, ())) |
                                                set(lines))
        self.data["seconds"] = round(self.data["seconds"] + seconds, 1)

    def missing(self, test_args: Sequence[str]) -> List[str]:
        return [t for t in test_args if t not in self.data["test_args"]]

    def fits(self, sources: Dict[str, str], keyword: Optional[str], interpreter: bool) -> bool:
        return self.data["sources"] == sources and self.data["keyword"] == keyword and \
            self.data.get("interpreter", interpreter) == interpreter

    def lines(self, path: str) -> Set[int]:
        """Every line of ``path`` some test (or the collection) executes."""
        found = set(self.data["outside"].get(path, ()))
        for test in self.data["tests"].values():
            found.update(test["lines"].get(path, ()))
        return found

    def covering(self, path: str, line: int) -> List[str]:
        """The node ids of the tests that execute ``line`` of ``path``, fastest first."""
        tests = [(test["seconds"], nodeid) for nodeid, test in self.data["tests"].items()
                 if line in set(test["lines"].get(path, ()))]
        return [nodeid for _, nodeid in sorted(tests)]

    def seconds(self, nodeids: Sequence[str]) -> float:
        return sum(self.data["tests"][n]["seconds"] for n in nodeids)

    def overhead(self) -> float:
        """The run's seconds outside the tests themselves (imports, collection)."""
        spent = sum(test["seconds"] for test in self.data["tests"].values())
        return max(0.0, self.data["seconds"] - spent)

    def save(self, file: Path) -> None:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(self.data, sort_keys=True) + "\n")


def map_file(folder: Path, paths: Sequence[str], keyword: Optional[str],
             interpreter: bool) -> Path:
    """Where the map of a group of modules is kept (its tests may grow: see ``find_map``)."""
    key = json.dumps([sorted(paths), keyword, interpreter])
    return folder / f"coverage-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def find_map(folder: Path, sources: Dict[str, str], keyword: Optional[str], interpreter: bool,
             tests: Sequence[str]) -> Optional[CoverageMap]:
    """A kept map of these sources (same hashes), keyword and interpreter setting whose test
    files are all still among ``tests`` (a map of a test since dropped would point mutants at
    it); the one that lacks the fewest."""
    found = []
    for file in sorted(folder.glob("coverage-*.json")) if folder.is_dir() else ():
        cover = CoverageMap(json.loads(file.read_text()))
        if cover.fits(sources, keyword, interpreter) and \
                set(cover.data["test_args"]) <= set(tests):
            found.append((len(cover.missing(tests)), file.name, cover))
    return min(found, key=lambda f: f[:2])[2] if found else None


def stages(nodeids: Sequence[str], first: int = FIRST_STAGE) -> List[List[str]]:
    """The covering tests in forks: the fastest ``first`` alone (most mutants die there, at the
    cost of collecting a few files), then the rest."""
    ordered = list(nodeids)
    return [part for part in (ordered[:first], ordered[first:]) if part]


__all__ = ["CoverageMap", "PerTestTracer", "find_map", "map_file", "source_hashes", "stages"]
