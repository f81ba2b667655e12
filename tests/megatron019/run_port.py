"""Run the Megatron-Core 0.19 port against 0.19's source and against dynctx, and count.

    .venv/bin/python -P tests/megatron019/run_port.py PATH [--ref core_v0.19.0] [--mode both]

``PATH`` is a Megatron-LM checkout: a git directory (a clone or a bare mirror; the runner
extracts ``megatron/`` at ``--ref`` with ``git archive`` into a temporary folder) or a folder
that already holds ``megatron/core`` at 0.19 (an extracted tree). Nothing of Megatron is copied
into this repository.

* **megatron019**: every test of ``tests/megatron019`` (the four ported files and the pinned
  ``InferenceConfig``, block-hash and shim tests) in one pytest process with
  ``DYNCTX_MEGATRON019_SRC`` set, so ``megatron`` is 0.19's package on the CPU shim. Every
  test must pass: this shows the port is faithful and that the pinned expectations are 0.19's.
* **dynctx**: the four ported files (marker ``mcore019``) against dynctx. Until 0.19's API is
  built most of them fail; the runner counts them and groups the failures by their first error
  line, which is where the gap list of ``README.md`` starts.

It prints one table of counts per file and mode, and exits 1 when a megatron019 test fails
(0 otherwise: dynctx failures are expected for now).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PORTED_FILES = (
    "test_mcore019_dynamic_context.py",
    "test_mcore019_kv_block_allocator.py",
    "test_mcore019_dynamic_prefix_caching.py",
    "test_mcore019_gpu_view.py",
)


def source_tree(path: Path, ref: str, workdir: Path) -> Path:
    """The folder holding 0.19's ``megatron/``: ``path`` itself, or ``ref`` extracted from it."""
    if (path / "megatron" / "core" / "package_info.py").is_file():
        return path
    probe = subprocess.run(["git", "--git-dir", str(_git_dir(path)), "rev-parse", "--verify",
                            f"{ref}^{{commit}}"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"{path} is neither a tree with megatron/core nor a git checkout with "
                         f"{ref}: {probe.stderr.strip()}")
    archive = subprocess.run(["git", "--git-dir", str(_git_dir(path)), "archive", ref,
                              "megatron"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive.stdout, check=True)
    print(f"extracted megatron/ at {ref} ({probe.stdout.strip()}) into {workdir}")
    return workdir


def _git_dir(path: Path) -> Path:
    return path / ".git" if (path / ".git").exists() else path


def run_pytest(mode: str, tree: Path, xml_path: Path, extra: List[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DYNCTX_MEGATRON019_SRC", None)
    if mode == "megatron019":
        env["DYNCTX_MEGATRON019_SRC"] = str(tree)
        targets = [str(HERE)]
    else:
        targets = [str(HERE / name) for name in PORTED_FILES]
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-o", "junit_family=xunit1", f"--junitxml={xml_path}", *targets, *extra]
    print(f"\n=== {mode}: {' '.join(cmd[3:6])} ... ({len(targets)} target(s))", flush=True)
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


Counts = Dict[str, collections.Counter]


def read_results(xml_path: Path) -> Tuple[Counts, collections.Counter]:
    """Per file: passed / failed / skipped; and the failures grouped by their first error line."""
    per_file: Counts = collections.defaultdict(collections.Counter)
    first_lines: collections.Counter = collections.Counter()
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        name = Path(case.get("file", "?")).name
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = (child.get("message") or "").strip().splitlines()
                first_lines[message[0][:160] if message else child.tag] += 1
            elif child.tag == "skipped":
                outcome = "skipped"
        per_file[name][outcome] += 1
    return per_file, first_lines


def table(results: Dict[str, Counts]) -> str:
    files = sorted({name for counts in results.values() for name in counts})
    rows = [("file", *(f"{mode} (pass/fail/skip)" for mode in results))]
    for name in files:
        cells = []
        for counts in results.values():
            c = counts.get(name)
            cells.append("-" if c is None else f"{c['passed']}/{c['failed']}/{c['skipped']}")
        rows.append((name, *cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="Megatron-LM checkout (git dir or 0.19 tree)")
    parser.add_argument("--ref", default="core_v0.19.0", help="tag or commit to extract")
    parser.add_argument("--mode", choices=("both", "megatron019", "dynctx"), default="both")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    results: Dict[str, Counts] = {}
    groups: Dict[str, collections.Counter] = {}
    status = 0
    with tempfile.TemporaryDirectory(prefix="mcore019-") as tmp:
        tmp_path = Path(tmp)
        tree = source_tree(args.path.expanduser().resolve(), args.ref, tmp_path)
        modes = ("megatron019", "dynctx") if args.mode == "both" else (args.mode,)
        for mode in modes:
            xml_path = tmp_path / f"{mode}.xml"
            rc = run_pytest(mode, tree, xml_path, args.pytest_args)
            results[mode], groups[mode] = read_results(xml_path)
            if mode == "megatron019" and rc != 0:
                status = 1
    print("\n" + table(results))
    if "dynctx" in groups and groups["dynctx"]:
        print("\ndynctx failures by first error line:")
        for line, count in groups["dynctx"].most_common():
            print(f"  {count:4d}  {line}")
    if status:
        print("\nmegatron019 mode failed: the port is not faithful to 0.19 (see above)")
    return status


if __name__ == "__main__":
    sys.exit(main())
