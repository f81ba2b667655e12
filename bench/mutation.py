"""Mutation testing: plant small bugs in the modules where a bug silently corrupts output, run
the tests that should catch them, and report per module how many the tests killed.

Each mutant changes one thing in a function body of the module (never a docstring, a string, an
error message, an assert or module-level code):

* operator: ``+`` <-> ``-``, ``*`` -> ``+``, ``//`` -> ``*``, ``%`` -> ``//``, ``<<`` <-> ``>>``,
  ``&`` <-> ``|``, comparisons (``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``is`` <->
  ``is not``, ``in`` <-> ``not in``), ``and`` <-> ``or``, a ``not`` / unary ``-`` / ``~`` dropped;
* constant: an int ``n`` -> ``n + 1`` (0 -> 1, 1 -> 0), ``True`` <-> ``False``, a float + 1;
* statement: an assignment, augmented assignment, call statement, ``break`` or ``continue``
  replaced by ``pass``.

The mutated source keeps every line where it was (operators and constants are replaced in place,
a removed statement leaves blank lines), so tracebacks, coverage and Triton's kernel source
(the interpreter re-reads it) line up with the original.

How a module is tested: ``TARGETS`` maps its path (relative to the repository root, as the code
moves: update the mapping, ``tests/test_mutation_targets.py`` checks that every path exists) to
the test files that should kill its mutants, whether they need the Triton interpreter, and
optionally the functions to mutate (the kernels' index arithmetic, not their tuning tables).
Per group of modules with the same tests (the four context modules share theirs; the six
paged-attention files theirs): one traced run of the tests unmutated (they must pass) that
records, per test, the lines of each module it executes and its seconds
(``bench/mutation_coverage.py``). Then, for each mutant (all, or a seeded sample), the tests that
execute its line (those that killed the module's earlier mutants first, then the fastest) in a
fork of a process that has imported torch, numpy, pytest
and (for the kernels) Triton, where the mutated file replaces the module (an import hook)
before pytest runs them with ``-x``: the first 8 in one fork, the rest in a second (a mutant
whose line runs while collecting runs every mapped file). A mutant on a line no test executes
survives without a run. Verdicts: ``killed`` (a test failed or the tests could not even
import it), ``timeout`` (over the limit: killed too), ``survived``.

    python -P bench/mutation.py                          # every module, every mutant
    python -P bench/mutation.py --sample 40 --seed 0     # 40 mutants per module
    python -P bench/mutation.py --modules engine/sampling.py --sample 20
    python -P bench/mutation.py --list                   # the mutants, without running
    python -P bench/mutation.py --rerun OLD.json         # OLD's survivors again, after new tests
    python -P bench/mutation.py --coverage-dir /tmp/cov ...   # keep the traced maps, reuse them

A run reads the checkout it sits in (``_CheckoutFinder``), whatever is installed: copy the
repository (``git worktree add`` or a copy of the tracked files) and run the copy's
``bench/mutation.py``, so that editing the working tree meanwhile changes nothing; the copy has
no ``.git``, so pass its revision as ``DYNCTX_GIT_REVISION``. ``--rerun`` takes one or more
earlier reports (of different modules), runs only their survivors against today's tests and
writes one report of the same mutants scored again, each module's earlier score kept as
``before`` and the mutants the new tests killed as ``killed_since``; survivors that
CONTRIBUTING.md's table names as equivalent (by module and line) are not run again, unless
``--named-too`` (a line can hold an equivalent survivor beside one a new test kills).

One thread (``OMP_NUM_THREADS=1``), one mutant at a time. The report (``--out``, default
``bench/results/mutation.json``) holds per module the score, the survivors (line, mutation and
source line) and how long it took; the text table goes to stdout. Not run in CI (hours for every
mutant); equivalent survivors are named in CONTRIBUTING.md ("Mutation testing").
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
# Under -P the script's own folder is not on sys.path; its sibling holds the per-test coverage.
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))
from mutation_coverage import (  # noqa: E402
    CoverageMap,
    PerTestTracer,
    find_map,
    map_file,
    source_hashes,
    stages,
)


@dataclasses.dataclass(frozen=True)
class Target:
    """How one module is mutated and tested."""

    tests: Tuple[str, ...]                 # test files (or ``file::test``), fastest killers first
    interpreter: bool = False              # the tests run Triton kernels (TRITON_INTERPRET=1)
    functions: Optional[Tuple[str, ...]] = None   # only these functions (``name`` or
    #                                               ``Class.method``); None: every function
    keyword: Optional[str] = None          # pytest ``-k``: leave out slow tests of other code


# The context's unit tests first (fast), then the random workloads (a few seconds each), then
# the capture dummies against megatron-core (12 s of importing it); the Megatron rope and
# hybrid-size comparisons test no bookkeeping.
CONTEXT_TESTS = ("tests/context/test_request_table_unbound.py",
                 "tests/context/test_block_allocator.py",
                 "tests/context/test_update_plan_stack.py", "tests/context/test_reset_state.py",
                 "tests/context/test_context.py", "tests/context/test_prefix_cache.py",
                 "tests/context/test_prefix_chains.py", "tests/context/test_hybrid.py",
                 "tests/context/test_cuda_graphs.py", "tests/context/test_error_snapshots.py",
                 "tests/context/test_decode_path.py", "tests/context/test_decode_path_review.py",
                 "tests/context/test_speculative.py", "tests/context/test_update_plan_mutants.py",
                 "tests/context/test_bad_inputs.py", "tests/context/test_request_table_mutants.py",
                 "tests/context/test_block_allocator_mutants.py",
                 "tests/context/test_deferred_rewind.py", "tests/context/test_prefix_host_tier.py",
                 "tests/context/test_kv_groups_prefix.py",
                 "tests/context/test_cuda_graphs_megatron.py::test_capture_dummies_equal_megatron",
                 "tests/context/test_megatron_compat.py::test_move_and_swap_book_keeping_tensors")
CONTEXT_KEYWORD = "not rotary_methods_match_megatron and not sizes_equal_megatron"
# The prefix cache, its digests and its host tier (spilled blocks restored into new ones): the
# context's prefix tests, then two engines against transformers with the tier under pressure.
PREFIX_TESTS = ("tests/context/test_prefix_chains.py", "tests/context/test_prefix_cache.py",
                "tests/context/test_prefix_cache_mutants.py", "tests/context/test_prefix_match.py",
                "tests/context/test_prefix_host_tier.py", "tests/context/test_kv_groups_prefix.py",
                "tests/e2e/test_prefix_host_tier_e2e.py")
ATTENTION_TESTS = ("tests/kernels/test_paged_attention.py",
                   "tests/kernels/test_paged_attention_windows.py",
                   "tests/kernels/test_paged_attention_fp8.py",
                   "tests/kernels/test_launch_plan_lengths.py::TestUnderTheInterpreter",
                   "tests/kernels/test_launch_plan_lengths.py::"
                   "test_length_classes_follow_the_keys_walked_and_keep_the_last_answer")
PLAN_BACKENDS = ("tests/kernels/test_launch_plan.py::TestUnderTheInterpreter::"
                 "test_a_plan_never_serves_the_torch_backend")
TARGETS: Dict[str, Target] = {
    "context/update_plan.py": Target(CONTEXT_TESTS, keyword=CONTEXT_KEYWORD),
    "context/plan_scratch.py": Target(CONTEXT_TESTS, keyword=CONTEXT_KEYWORD),
    "context/request_table.py": Target(CONTEXT_TESTS, keyword=CONTEXT_KEYWORD),
    "context/block_allocator.py": Target(CONTEXT_TESTS, keyword=CONTEXT_KEYWORD),
    "context/prefix_cache.py": Target(PREFIX_TESTS),
    # The digests and the table of cached blocks (not the statistics' names and rates).
    "context/prefix_digests.py": Target(PREFIX_TESTS, functions=(
        "salt_digest", "chain_links", "wants_every_prompt_logit", "forget", "clear")),
    "context/host_tier.py": Target(PREFIX_TESTS),
    "engine/sampling.py": Target(("tests/e2e/test_finish_rule.py::test_finish_reason",
                                  "tests/e2e/test_sampling_oracle.py",
                                  "tests/e2e/test_sampling_edges.py",
                                  "tests/e2e/test_sampling.py",
                                  "tests/e2e/test_sampling_mutants.py",
                                  "tests/e2e/test_finish_rule.py")),
    "kernels/kv_append.py": Target(("tests/kernels/test_kv_append.py",
                                    "tests/kernels/test_kv_append_fp8.py", PLAN_BACKENDS),
                                   interpreter=True,
                                   functions=("_kv_append_kernel", "kv_append")),
    # The launcher and its plan's launches for other row counts (_row_classes, _vary_rows).
    "kernels/compaction.py": Target(("tests/kernels/test_compaction.py", PLAN_BACKENDS,
                                     "tests/kernels/test_launch_plan_lengths.py::"
                                     "TestCountLaunchersUnderTheInterpreter"),
                                    interpreter=True,
                                    functions=("_compact_requests_kernel", "compact_requests",
                                               "_row_classes", "_vary_rows")),
    # Paged attention: the launcher (validation aside) and, per file since the split, the
    # kernels and launchers' index arithmetic (the config tables and tuning cases are not).
    "kernels/paged_attention.py": Target(ATTENTION_TESTS, interpreter=True,
                                         functions=("paged_attention",)),
    "kernels/paged_attention_tile.py": Target(ATTENTION_TESTS, interpreter=True,
                                              functions=("_attend_key_tile", "kernel_args")),
    "kernels/paged_attention_decode.py": Target(
        ATTENTION_TESTS, interpreter=True,
        functions=("_paged_attention_decode_kernel", "launch_decode")),
    "kernels/paged_attention_varlen.py": Target(
        ATTENTION_TESTS, interpreter=True,
        functions=("_paged_attention_varlen_kernel", "launch_varlen")),
    # The plan's key classes, its capacity check and its launches for other split and tile
    # counts (not the role bookkeeping of __init__).
    "kernels/paged_attention_plan.py": Target(
        ATTENTION_TESTS, interpreter=True,
        functions=("length_classes", "_fits", "launches_for", "_vary", "launch")),
    "kernels/paged_attention_merge.py": Target(
        ATTENTION_TESTS, interpreter=True,
        functions=("_merge_attention_splits_kernel", "merge_chunk", "merge_attention_splits",
                   "merge_splits_launch")),
}
RESULTS = ROOT / "bench" / "results" / "mutation.json"


# ---------------------------------------------------------------- mutants
@dataclasses.dataclass(frozen=True)
class Mutant:
    path: str          # module path, relative to the repository root
    index: int         # position in the module's list
    line: int
    kind: str          # "operator", "constant" or "statement"
    description: str   # e.g. "+ -> -"
    begin: int         # character offsets of the replaced text in the source
    finish: int
    replacement: str
    line_offset: int = 0   # character offset of the start of ``line``

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line} {self.kind} {self.description}"


BINARY = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "+"), ast.FloorDiv: ("//", "*"),
          ast.Div: ("/", "*"), ast.Mod: ("%", "//"), ast.LShift: ("<<", ">>"),
          ast.RShift: (">>", "<<"), ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&"),
          ast.BitXor: ("^", "&"), ast.Pow: ("**", "*")}
COMPARE = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
           ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is not", "is"),
           ast.IsNot: ("is not", "is"), ast.In: ("not in", "in"), ast.NotIn: ("not in", "in")}
BOOLEAN = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
UNARY = {ast.Not: "not", ast.USub: "-", ast.Invert: "~"}


def _offsets(source: str) -> List[int]:
    """Character offset of the start of each line (index 0: line 1)."""
    starts, total = [], 0
    for line in source.splitlines(keepends=True):
        starts.append(total)
        total += len(line)
    starts.append(total)
    return starts


class _Collector(ast.NodeVisitor):
    """Finds the mutation points of the function bodies in ``functions`` (None: all)."""

    def __init__(self, source: str, functions: Optional[Sequence[str]]):
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.offsets = _offsets(source)
        self.functions = set(functions) if functions is not None else None
        self.points: List[Tuple[str, int, str, Tuple[int, int], Tuple[int, int], str]] = []
        self._scope: List[str] = []
        self._active = 0

    # -- helpers
    def _pos(self, line: int, col: int) -> int:
        """Character offset of (line, byte column) (ast columns count UTF-8 bytes)."""
        text = self.lines[line - 1].encode()[:col].decode(errors="ignore")
        return self.offsets[line - 1] + len(text)

    def _segment(self, start: Tuple[int, int], end: Tuple[int, int]) -> str:
        return self.source[self._pos(*start):self._pos(*end)]

    def _operator_between(self, left: ast.AST, right: ast.AST, symbol: str,
                          new: str, kind: str = "operator") -> None:
        """Replace ``symbol`` in the text between ``left`` and ``right`` (parentheses,
        comments and whitespace aside) by ``new``."""
        start, end = (left.end_lineno, left.end_col_offset), (right.lineno, right.col_offset)
        gap = self._segment(start, end)
        # Comments blanked (same length), so positions in ``bare`` are positions in ``gap``.
        bare = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), gap)
        tokens = bare.replace("(", " ").replace(")", " ").split()
        if " ".join(tokens) != symbol:
            return
        at = re.search(r"(?<![\w=<>!*/])" + r"\s+".join(map(re.escape, symbol.split()))
                       + r"(?![\w=*/])", bare)
        if at is None:
            return
        begin = self._pos(*start) + at.start()
        finish = self._pos(*start) + at.end()
        self._add_span(kind, left.end_lineno, f"{symbol} -> {new}", begin, finish, new)

    def _add_span(self, kind, line, description, begin, finish, replacement) -> None:
        self.points.append((kind, line, description, begin, finish, replacement))

    # -- scopes
    def _visit_function(self, node) -> None:
        self._scope.append(node.name)
        name = ".".join(self._scope[-2:]) if len(self._scope) > 1 else node.name
        chosen = self.functions is None or node.name in self.functions or \
            name in self.functions
        self._active += chosen
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]   # the docstring
        for statement in body:
            self.visit(statement)
        self._active -= chosen
        self._scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_ClassDef(self, node) -> None:
        self._scope.append(node.name)
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.visit(statement)
        self._scope.pop()

    def visit_Module(self, node) -> None:
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.visit(statement)
            elif isinstance(statement, ast.If):   # ``if HAS_TRITON:`` around the kernels
                for inner in statement.body + statement.orelse:
                    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        self.visit(inner)

    # -- what is never mutated
    def visit_Raise(self, node) -> None:
        pass

    def visit_Assert(self, node) -> None:
        pass

    def visit_JoinedStr(self, node) -> None:
        pass

    # -- statements
    def _statement(self, node) -> None:
        if self._active and not self._is_logging(node):
            begin = self._pos(node.lineno, node.col_offset)
            finish = self._pos(node.end_lineno, node.end_col_offset)
            blank = "pass" + "\n" * (node.end_lineno - node.lineno)
            self._add_span("statement", node.lineno, f"{type(node).__name__} -> pass", begin,
                           finish, blank)
        self.generic_visit(node)

    @staticmethod
    def _is_logging(node) -> bool:
        value = getattr(node, "value", None)
        func = getattr(value, "func", None)
        owner = getattr(func, "value", None)
        return isinstance(owner, ast.Name) and owner.id in ("logger", "logging", "warnings")

    def visit_Assign(self, node) -> None:
        self._statement(node)

    def visit_AugAssign(self, node) -> None:
        self._statement(node)
        if self._active and type(node.op) in BINARY:
            symbol, new = BINARY[type(node.op)]
            self._operator_between(node.target, node.value, symbol + "=", new + "=")

    def visit_AnnAssign(self, node) -> None:
        if node.value is not None:
            self._statement(node)

    def visit_Expr(self, node) -> None:
        if isinstance(node.value, ast.Call):
            self._statement(node)
        else:
            self.generic_visit(node)

    def visit_Break(self, node) -> None:
        self._statement(node)

    def visit_Continue(self, node) -> None:
        self._statement(node)

    # -- expressions
    def visit_BinOp(self, node) -> None:
        if self._active and type(node.op) in BINARY:
            symbol, new = BINARY[type(node.op)]
            self._operator_between(node.left, node.right, symbol, new)
        self.generic_visit(node)

    def visit_Compare(self, node) -> None:
        if self._active:
            left = node.left
            for op, right in zip(node.ops, node.comparators):
                symbol, new = COMPARE[type(op)]
                if isinstance(op, (ast.Is, ast.In)):
                    symbol, new = new, symbol   # is -> is not, in -> not in
                self._operator_between(left, right, symbol, new)
                left = right
        self.generic_visit(node)

    def visit_BoolOp(self, node) -> None:
        if self._active:
            symbol, new = BOOLEAN[type(node.op)]
            self._operator_between(node.values[0], node.values[1], symbol, new)
        self.generic_visit(node)

    def visit_UnaryOp(self, node) -> None:
        if self._active and type(node.op) in UNARY:
            begin = self._pos(node.lineno, node.col_offset)
            finish = self._pos(node.operand.lineno, node.operand.col_offset)
            symbol = UNARY[type(node.op)]
            if self.source[begin:finish].strip() == symbol:
                self._add_span("operator", node.lineno, f"{symbol} dropped", begin, finish, "")
        self.generic_visit(node)

    def visit_Constant(self, node) -> None:
        if not self._active:
            return
        value = node.value
        if isinstance(value, bool):
            new = repr(not value)
        elif isinstance(value, int):
            new = {0: "1", 1: "0"}.get(value, repr(value + 1))
        elif isinstance(value, float):
            new = repr(value + 1.0)
        else:
            return
        begin = self._pos(node.lineno, node.col_offset)
        finish = self._pos(node.end_lineno, node.end_col_offset)
        self._add_span("constant", node.lineno, f"{self.source[begin:finish]} -> {new}", begin,
                       finish, f"({new})" if new.startswith("-") else new)


def find_mutants(path: str, source: str, functions: Optional[Sequence[str]] = None
                 ) -> List[Mutant]:
    """Every mutant of ``source`` (the module at ``path``), in source order."""
    collector = _Collector(source, functions)
    collector.visit(ast.parse(source))
    points = sorted(collector.points, key=lambda p: (p[3], p[4], p[2]))
    starts = _offsets(source)
    return [Mutant(path=path, index=i, line=line, kind=kind, description=description,
                   begin=begin, finish=finish, replacement=replacement,
                   line_offset=starts[line - 1])
            for i, (kind, line, description, begin, finish, replacement) in enumerate(points)]


def mutated_source(source: str, mutant: Mutant) -> str:
    return source[:mutant.begin] + mutant.replacement + source[mutant.finish:]


def check_mutant_compiles(source: str, mutant: Mutant) -> bool:
    try:
        compile(mutated_source(source, mutant), mutant.path, "exec")
    except SyntaxError:
        return False
    return True


# ---------------------------------------------------------------- the module map
def package_dirs() -> Dict[str, Path]:
    """pyproject's ``package-dir`` mapping: import package -> folder of this checkout."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as handle:
        package_dir = tomllib.load(handle)["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in package_dir.items()}


def module_name(path: str) -> str:
    """The import name of the file at ``path`` (pyproject's ``package-dir`` mapping)."""
    folders = {folder.relative_to(ROOT).as_posix(): package
               for package, folder in package_dirs().items()}
    parts = Path(path).with_suffix("").parts
    if parts[0] not in folders:
        raise ValueError(f"{path}: its folder {parts[0]!r} is not a package in pyproject.toml")
    return ".".join((folders[parts[0]],) + parts[1:])


class _CheckoutFinder:
    """Imports the ``dynctx`` packages from this checkout, whatever is installed (so that a
    copy of the repository can be mutated while the working tree changes)."""

    def __init__(self):
        self.dirs = package_dirs()

    def find_spec(self, name, path=None, target=None):
        import importlib.util

        if name in self.dirs:
            folder = self.dirs[name]
            return importlib.util.spec_from_file_location(
                name, folder / "__init__.py", submodule_search_locations=[str(folder)])
        parent, _, leaf = name.rpartition(".")
        if parent in self.dirs and (self.dirs[parent] / f"{leaf}.py").is_file():
            return importlib.util.spec_from_file_location(name, self.dirs[parent] / f"{leaf}.py")
        return None


# ---------------------------------------------------------------- running
@dataclasses.dataclass
class Outcome:
    verdict: str         # "killed", "timeout", "survived", "not covered"
    seconds: float
    detail: str = ""     # the first failing test, or why
    tests: int = 0       # how many tests execute the mutant's line


def _warm_imports(interpreter: bool) -> None:
    """What every run imports, loaded once before the forks (never dynctx itself)."""
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch

    torch.set_num_threads(1)
    import hypothesis  # noqa: F401
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    if interpreter:
        import triton  # noqa: F401
        import triton.language  # noqa: F401


class _MutantFinder:
    """Serves ``name`` from ``path`` (the mutated copy) to every import."""

    def __init__(self, name: str, path: str):
        self.name, self.path = name, path

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(name, self.path)


def _child(tests: Sequence[str], keyword: Optional[str], name: Optional[str],
           mutant_file: Optional[str], trace_files: Optional[Sequence[str]],
           coverage_out: Optional[str], log: str) -> None:
    """In the forked child: install the mutant, run pytest, exit with its code; with
    ``trace_files``, write per test the lines of those files it executes to ``coverage_out``."""
    sys.dont_write_bytecode = True
    sys.meta_path.insert(0, _CheckoutFinder())
    if mutant_file is not None:
        sys.meta_path.insert(0, _MutantFinder(name, mutant_file))
    tracer = PerTestTracer(trace_files) if trace_files else None
    if tracer is not None:
        tracer.start()
    import pytest

    interpreter = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    # The markers of tests/run_tests.sh's process for this kind of test.
    markers = "interpreter and not slow" if interpreter else \
        "not interpreter and not gpu and not slow"
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        selection = ["-k", keyword] if keyword else []
        code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0",
                            "-o", "addopts=-rfE --strict-markers", "-m", markers, *selection,
                            *tests], plugins=[tracer] if tracer is not None else [])
    if tracer is not None:
        tracer.stop()
        with open(coverage_out, "w") as handle:
            json.dump(tracer.as_json(ROOT), handle)
    os._exit(int(code))


def _run(tests, keyword, name, mutant_file, timeout, trace_files=None
         ) -> Tuple[Optional[int], float, str, Optional[dict]]:
    """Fork, run the tests; ``(exit code or None on timeout, seconds, log tail, per-test
    coverage of trace_files or None)``."""
    with tempfile.TemporaryDirectory() as scratch:
        log, coverage_out = os.path.join(scratch, "log"), os.path.join(scratch, "cover.json")
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            try:
                _child(tests, keyword, name, mutant_file, trace_files, coverage_out, log)
            finally:
                os._exit(70)
        code = None
        try:
            while time.perf_counter() - start < timeout:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    code = os.waitstatus_to_exitcode(status)
                    break
                time.sleep(0.05)
        finally:   # over time, or the worker stopped (SIGTERM): the tests go too
            if code is None:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        seconds = time.perf_counter() - start
        tail = Path(log).read_text(errors="replace")[-4000:] if os.path.exists(log) else ""
        traced = json.loads(Path(coverage_out).read_text()) \
            if os.path.exists(coverage_out) else None
        return code, seconds, tail, traced


def _first_failure(log: str) -> str:
    for line in log.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    for line in reversed(log.splitlines()):
        if line.strip():
            return line.strip()[:200]
    return ""


def survivor_key(line: int, column: Optional[int], mutation: str) -> Tuple[int, int, str]:
    return line, -1 if column is None else column, mutation


def select_survivors(mutants: Sequence[Mutant], survivors: Sequence[dict]) -> List[Mutant]:
    """The mutants an earlier report lists as survivors (by line, column and mutation; a
    survivor recorded without its column matches every column of its line)."""
    wanted = {survivor_key(s["line"], s.get("column"), s["mutation"]) for s in survivors}
    chosen = []
    for m in mutants:
        column = m.begin - m.line_offset
        mutation = f"{m.kind} {m.description}"
        if survivor_key(m.line, column, mutation) in wanted or \
                survivor_key(m.line, None, mutation) in wanted:
            chosen.append(m)
    return chosen


def _run_stages(parts: Sequence[Sequence[str]], keyword: Optional[str], name: str,
                mutant_file: str, timeout: float) -> "Outcome":
    """One mutant against the tests of ``parts`` (node ids, or test files), each part in its
    own fork, in order, up to the first failure: a mutant the first part kills costs the
    collection of that part's files only, not every file's (collecting the context's files
    alone takes about 10 s). ``timeout`` bounds them all."""
    spent = 0.0
    for part in parts:
        code, seconds, log, _ = _run([str(ROOT / t) for t in part], keyword, name,
                                     mutant_file, timeout - spent)
        spent += seconds
        if code is None:
            return Outcome("timeout", spent, f"over {timeout:.0f} s")
        if code not in (0, 5):   # 5: the keyword or the markers left no test of this file
            return Outcome("killed", spent, _first_failure(log))
    return Outcome("survived", spent)


def group_of(path: str) -> List[str]:
    """The mapped modules tested like ``path`` (same tests, keyword and interpreter setting):
    one traced run of those tests maps them all."""
    target = TARGETS[path]
    return sorted(p for p, t in TARGETS.items() if (t.tests, t.keyword, t.interpreter) ==
                  (target.tests, target.keyword, target.interpreter))


def coverage_for(path: str, folder: Optional[Path],
                 cache: Dict[str, CoverageMap]) -> CoverageMap:
    """The per-test coverage of ``path``'s tests over its group's modules: from ``cache`` (this
    process), else from ``folder`` (an earlier run's map, its missing test files traced now),
    else one traced run of the tests unmutated (they must pass)."""
    target, group = TARGETS[path], group_of(path)
    key = group[0]
    if key in cache:
        return cache[key]
    sources = source_hashes(ROOT, group)
    found = None if folder is None else \
        find_map(folder, sources, target.keyword, target.interpreter, target.tests)
    if found is None:
        found = CoverageMap.empty(sources, target.keyword, target.interpreter)
    missing = found.missing(target.tests)
    if missing:
        print(f"   tracing {len(missing)} test files unmutated over {' '.join(group)}",
              flush=True)
        code, seconds, log, traced = _run([str(ROOT / t) for t in missing], target.keyword,
                                          None, None, 4 * 3600,
                                          trace_files=[str(ROOT / p) for p in group])
        if code not in (0, 5) or traced is None:
            raise SystemExit(f"{path}: the tests fail unmutated (exit {code}):\n{log}")
        found.add(missing, traced, seconds)
        if folder is not None:
            found.save(map_file(folder, group, target.keyword, target.interpreter))
    cache[key] = found
    return found


def run_module(path: str, target: Target, *, sample: Optional[int], seed: int,
               timeout_factor: float, min_timeout: float, max_seconds: Optional[float],
               survivors: Optional[Sequence[dict]] = None,
               progress: Optional[Callable[[dict], None]] = None,
               coverage_dir: Optional[Path] = None,
               cache: Optional[Dict[str, CoverageMap]] = None) -> dict:
    """Baseline and mutants of one module (in this process: the caller set the environment);
    with ``survivors`` (an earlier report's), only those mutants. Each mutant runs the tests
    that execute its line (per-test coverage of the unmutated run), fastest first; one whose
    line only the collection executes runs every test file. ``progress`` gets the module's
    report so far after each mutant."""
    source = (ROOT / path).read_text()
    name = module_name(path)
    mutants = [m for m in find_mutants(path, source, target.functions)
               if check_mutant_compiles(source, m)]
    total = len(mutants)
    if survivors is not None:
        mutants = select_survivors(mutants, survivors)
        missing = len(survivors) - len(mutants)
        if missing:
            print(f"   {missing} of {len(survivors)} survivors no longer exist (the code "
                  "changed): run the module again", flush=True)
    elif sample is not None and sample < total:
        mutants = sorted(random.Random(f"{seed}:{path}").sample(mutants, sample),
                         key=lambda m: m.index)
    print(f"== {path} ({name}): {total} mutants, {len(mutants)} to run; tests: "
          f"{' '.join(target.tests)}", flush=True)
    coverage = coverage_for(path, coverage_dir, {} if cache is None else cache)
    covered = coverage.lines(path)
    collected = set(coverage.data["outside"].get(path, ()))
    baseline, overhead = coverage.data["seconds"], coverage.overhead()
    print(f"   baseline {baseline:.1f} s ({overhead:.1f} s outside the tests), "
          f"{len(coverage.data['tests'])} tests, {len(covered)} lines executed", flush=True)
    results = []
    kills: Dict[str, int] = {}   # node id -> mutants of this module it killed
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        mutant_file = os.path.join(scratch, Path(path).name)
        for number, mutant in enumerate(mutants, 1):
            if max_seconds is not None and time.perf_counter() - started > max_seconds:
                print(f"   time budget spent after {number - 1} mutants", flush=True)
                break
            # The tests that killed earlier mutants first (a module's killers are few), then
            # the fastest.
            tests = sorted(coverage.covering(path, mutant.line), key=lambda t: -kills.get(t, 0))
            if mutant.line not in covered:
                outcome = Outcome("not covered", 0.0, "no test executes this line")
            else:
                parts = stages(tests) if mutant.line not in collected else [list(target.tests)]
                timeout = max(min_timeout, timeout_factor * (coverage.seconds(tests) + overhead))
                Path(mutant_file).write_text(mutated_source(source, mutant))
                outcome = _run_stages(parts, target.keyword, name, mutant_file, timeout)
            outcome.tests = len(tests)
            results.append((mutant, outcome))
            killer = outcome.detail.partition(" ")[2]
            if outcome.verdict == "killed" and killer:
                kills[killer] = kills.get(killer, 0) + 1
            mark = {"killed": ".", "timeout": "T", "survived": "S", "not covered": "N"}
            print(f"   [{number}/{len(mutants)}] {mark[outcome.verdict]} {mutant.name} "
                  f"({outcome.seconds:.1f} s, {len(tests)} tests) {outcome.detail}", flush=True)
            if progress is not None:
                progress(_summary(path, target, total, baseline, source, results,
                                  complete=False))
    return _summary(path, target, total, baseline, source, results, complete=True)


def _summary(path: str, target: Target, total: int, baseline: float, source: str,
             results: Sequence[Tuple[Mutant, "Outcome"]], complete: bool) -> dict:
    """One module's part of the report (``complete``: False while its run goes on)."""
    name = module_name(path)
    lines_of = source.splitlines()
    counts = {v: sum(o.verdict == v for _, o in results)
              for v in ("killed", "timeout", "survived", "not covered")}
    run = len(results)
    return {
        "module": path, "import": name, "tests": list(target.tests), "keyword": target.keyword,
        "functions": list(target.functions) if target.functions else None,
        "interpreter": target.interpreter, "mutants": total, "run": run, **counts,
        "complete": complete,
        "score": round((counts["killed"] + counts["timeout"]) / run, 4) if run else None,
        "baseline_seconds": round(baseline, 1),
        "seconds": round(sum(o.seconds for _, o in results), 1),
        "survivors": [{"line": m.line, "column": m.begin - m.line_offset,
                       "mutation": f"{m.kind} {m.description}",
                       "verdict": o.verdict, "source": lines_of[m.line - 1].strip()}
                      for m, o in results if o.verdict in ("survived", "not covered")],
        "killed_by": sorted({o.detail for _, o in results if o.verdict == "killed"}),
        "verdicts": [{"line": m.line, "column": m.begin - m.line_offset,
                      "mutation": f"{m.kind} {m.description}", "verdict": o.verdict,
                      "detail": o.detail, "covering_tests": o.tests} for m, o in results],
    }


def combine_reports(reports: Sequence[dict]) -> dict:
    """Earlier reports as one: their modules (each module in one report only) and, as
    ``runs``, the command, revision and date of each (a rerun's: those of the runs it redid; a
    joined report's: its ``runs``)."""
    modules, runs = [], []
    for report in reports:
        modules += report["modules"]
        runs += report.get("rerun_of") or report.get("runs") or [
            {k: report[k] for k in ("command", "git_revision", "date", "sample", "seed")}]
    names = [m["module"] for m in modules]
    if len(set(names)) != len(names):
        raise SystemExit(f"--rerun: a module is in several reports: {sorted(names)}")
    samples = set()
    for report in reports:   # a joined report's sample: the list of its runs' samples
        sample = report["sample"]
        samples.update(sample if isinstance(sample, list) else [sample])
    return {"modules": modules, "runs": runs,
            "sample": samples.pop() if len(samples) == 1 else sorted(samples, key=str),
            "seed": reports[0]["seed"]}


def merge_rerun(before: dict, rerun: Optional[dict]) -> dict:
    """One module of an earlier report with its survivors' new verdicts (``rerun``: the
    ``run_module`` result over them, None when it had none): the same mutants, scored again,
    with the earlier score kept as ``before``."""
    merged = dict(before)
    merged["before"] = {k: before[k] for k in ("score", "run", "survived", "not covered")}
    if rerun is None:
        return merged
    verdicts = {survivor_key(v["line"], v["column"], v["mutation"]): v
                for v in rerun["verdicts"]}
    survivors, newly = [], []
    for survivor in before["survivors"]:
        found = verdicts.get(survivor_key(survivor["line"], survivor.get("column"),
                                          survivor["mutation"]))
        if found is None or found["verdict"] in ("survived", "not covered"):
            survivors.append(survivor if found is None else dict(survivor,
                                                                  verdict=found["verdict"]))
        else:
            newly.append(dict(survivor, verdict=found["verdict"], detail=found["detail"]))
    counts = {v: before[v] for v in ("killed", "timeout")}
    for item in newly:
        counts[item["verdict"]] += 1
    run = before["run"]
    merged.update(counts, survivors=survivors, killed_since=newly,
                  survived=sum(s["verdict"] == "survived" for s in survivors),
                  tests=rerun["tests"], keyword=rerun["keyword"])
    merged["not covered"] = sum(s["verdict"] == "not covered" for s in survivors)
    merged["score"] = round((counts["killed"] + counts["timeout"]) / run, 4) if run else None
    return merged


def named_equivalent(text: Optional[str] = None) -> set:
    """``(module, line)`` of each survivor CONTRIBUTING.md's table names as equivalent: a
    ``--rerun`` leaves them out (they stay survivors in its report)."""
    if text is None:
        path = ROOT / "CONTRIBUTING.md"
        text = path.read_text() if path.exists() else ""
    # The table after the "Equivalent survivors" heading line, up to its first blank line.
    start = text.find("Equivalent survivors")
    table = text[start:].split("\n\n")[1] if start >= 0 and "\n\n" in text[start:] else ""
    found = re.findall(r"^\| `([\w/]+\.py)` \| (\d+) \|", table, flags=re.M)
    return {(module, int(line)) for module, line in found}


def _revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("DYNCTX_GIT_REVISION", "unknown")


def score_named(module: dict, named: set) -> dict:
    """The survivors CONTRIBUTING.md names as equivalent, and the score of the others:
    killed / (run - equivalent)."""
    equivalent = sum((module["module"], s["line"]) in named
                     for s in module.get("survivors", ()))
    rest = module["run"] - equivalent
    killed = module["killed"] + module["timeout"]
    return {"equivalent": equivalent,
            "score_without_equivalent": round(killed / rest, 4) if rest else None}


def table(modules: List[dict]) -> str:
    def percent(score):
        return "-" if score is None else f"{100 * score:.1f}%"

    rows = [f"{'module':34} {'mutants':>7} {'run':>5} {'killed':>6} {'timeout':>7} "
            f"{'survived':>8} {'uncovered':>9} {'score':>6} {'before':>6} {'equiv':>5} "
            f"{'w/o eq':>6}"]
    named = named_equivalent()
    for m in modules:
        before = percent(m["before"]["score"]) if "before" in m else ""
        eq = score_named(m, named)
        rows.append(f"{m['module']:34} {m['mutants']:7} {m['run']:5} {m['killed']:6} "
                    f"{m['timeout']:7} {m['survived']:8} {m['not covered']:9} "
                    f"{percent(m['score']):>6} {before:>6} {eq['equivalent']:5} "
                    f"{percent(eq['score_without_equivalent']):>6}")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", default=None, choices=list(TARGETS),
                        help="default: every module (with --rerun: every module of the report)")
    parser.add_argument("--sample", type=int, default=None,
                        help="mutants per module, drawn with --seed (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-factor", type=float, default=2.0,
                        help="per-mutant limit as a multiple of the baseline run")
    parser.add_argument("--min-timeout", type=float, default=60.0)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="time budget per module for its mutants")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--coverage-dir", type=Path, default=None,
                        help="keep the per-test coverage maps here, and read them again: a "
                             "later run (a --rerun after new tests) traces only the test files "
                             "a map lacks")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--rerun", type=Path, nargs="+", default=None,
                        help="earlier reports (of different modules): run their survivors "
                             "again (after new tests) and write one report of the same "
                             "mutants scored again, the earlier scores as 'before'")
    parser.add_argument("--named-too", action="store_true",
                        help="with --rerun: run the survivors CONTRIBUTING.md names equivalent "
                             "too (a line can hold an equivalent survivor and one a new test "
                             "kills: the table names lines)")
    parser.add_argument("--join", type=Path, nargs="+", default=None,
                        help="reports of separate runs (different modules, run side by side): "
                             "write them as one report, running nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.join is not None:
        joined = combine_reports([json.loads(path.read_text()) for path in args.join])
        named = named_equivalent()
        joined["modules"] = [dict(m, **score_named(m, named)) for m in joined["modules"]]
        report = {"tool": "bench/mutation.py", "runs": joined["runs"],
                  "command": "python -P bench/mutation.py " + " ".join(
                      argv if argv is not None else sys.argv[1:]),
                  "git_revision": sorted({run["git_revision"] for run in joined["runs"]}),
                  "date": datetime.date.today().isoformat(), "sample": joined["sample"],
                  "seed": joined["seed"], "modules": joined["modules"],
                  "complete": all(m.get("complete", True) for m in joined["modules"])}
        args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        print(table(joined["modules"]))
        return 0
    earlier = None if args.rerun is None else \
        combine_reports([json.loads(path.read_text()) for path in args.rerun])
    if args.modules is None:
        args.modules = list(TARGETS) if earlier is None else \
            [m["module"] for m in earlier["modules"]]
    named = set() if args.named_too else named_equivalent()
    survivors_of = {} if earlier is None else \
        {m["module"]: [s for s in m["survivors"] if (m["module"], s["line"]) not in named]
         for m in earlier["modules"]}

    if args.list:
        for path in args.modules:
            source = (ROOT / path).read_text()
            for m in find_mutants(path, source, TARGETS[path].functions):
                if check_mutant_compiles(source, m):
                    print(m.name)
        return 0
    if args.worker:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        interpreter = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        _warm_imports(interpreter)
        # The part file holds every finished module and the current one so far, rewritten
        # after each mutant: a run stopped early keeps what it measured.
        modules: List[dict] = []
        maps: Dict[str, CoverageMap] = {}

        def write(current: Optional[dict] = None) -> None:
            args.out.write_text(json.dumps(modules + ([current] if current else [])))

        for p in args.modules:
            if earlier is None or survivors_of.get(p):
                modules.append(run_module(
                    p, TARGETS[p], sample=args.sample, seed=args.seed,
                    timeout_factor=args.timeout_factor, min_timeout=args.min_timeout,
                    max_seconds=args.max_seconds, progress=write,
                    survivors=survivors_of[p] if earlier is not None else None,
                    coverage_dir=args.coverage_dir, cache=maps))
                write()
        write()
        return 0

    # One worker process per interpreter setting: TRITON_INTERPRET is read at import.
    started = time.perf_counter()
    stopped = False
    modules: List[dict] = []
    for interpreter in (False, True):
        paths = [p for p in args.modules if TARGETS[p].interpreter == interpreter
                 and (earlier is None or survivors_of.get(p))]
        if not paths:
            continue
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        env["TRITON_INTERPRET"] = "1" if interpreter else "0"
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            part = handle.name
        command = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker",
                   "--modules", *paths, "--seed", str(args.seed),
                   "--timeout-factor", str(args.timeout_factor),
                   "--min-timeout", str(args.min_timeout), "--out", part]
        if args.sample is not None:
            command += ["--sample", str(args.sample)]
        if args.max_seconds is not None:
            command += ["--max-seconds", str(args.max_seconds)]
        if args.coverage_dir is not None:
            command += ["--coverage-dir", str(args.coverage_dir.resolve())]
        if args.rerun is not None:
            command += ["--rerun", *(str(path.resolve()) for path in args.rerun)]
            if args.named_too:
                command.append("--named-too")
        worker = subprocess.Popen(command, env=env, cwd=ROOT)
        try:
            code = worker.wait()
        except KeyboardInterrupt:   # stopped: report what was measured, marked incomplete
            worker.terminate()
            code = worker.wait()
            stopped = True
        text = Path(part).read_text()
        os.unlink(part)
        if code != 0 and not stopped:
            raise SystemExit(f"the worker failed (exit {code})")
        modules += json.loads(text) if text else []
        if stopped:
            break
    if earlier is not None:
        rerun = {m["module"]: m for m in modules}
        modules = [merge_rerun(m, rerun.get(m["module"])) for m in earlier["modules"]
                   if m["module"] in args.modules]
    order = {p: i for i, p in enumerate(args.modules)}
    modules.sort(key=lambda m: order[m["module"]])
    report = {
        "tool": "bench/mutation.py",
        "command": "python -P bench/mutation.py " + " ".join(argv if argv is not None
                                                             else sys.argv[1:]),
        "git_revision": _revision(),
        "date": datetime.date.today().isoformat(),
        "sample": args.sample, "seed": args.seed,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "modules": modules,
        "complete": not stopped and all(m.get("complete", True) for m in modules),
    }
    if earlier is not None:
        report.update(sample=earlier["sample"], seed=earlier["seed"],
                      rerun_of=earlier["runs"])
    if args.out != Path("-"):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(table(modules))
    return 0


__all__ = ["TARGETS", "Target", "Mutant", "find_mutants", "module_name", "mutated_source",
           "run_module"]

if __name__ == "__main__":
    sys.exit(main())
