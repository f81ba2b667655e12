"""The bench scripts leave the checkout as they found it: results go where ``--json`` points and
nowhere else (not into the committed ``bench/results/``, not into the working directory), and
the long test drivers that moved out of ``bench/`` (the soak, the prefix-caching fuzz) still run
from their new place.

Each script runs in-process on the smallest workload its flags allow, from an empty working
directory; the checkout's files (the virtual environment and caches aside) are compared before
and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".benchmarks",
             "build", "dynctx.egg-info", ".device_carry", ".whl"}


def checkout_files() -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime_ns)}`` of the checkout's files, caches left out."""
    found = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            path = Path(folder) / name
            stat = path.stat()
            found[str(path.relative_to(ROOT))] = (stat.st_size, stat.st_mtime_ns)
    return found


def succeeded(outcome) -> bool:
    """An exit code of 0, or ``engine_throughput``'s result with identical outputs."""
    return outcome == 0 or (isinstance(outcome, dict) and outcome.get("identical") is True)


# script: (the smallest workload, whether it takes --json)
BENCHES = {
    # Ten requests: the first computes the prefix, the other nine (90 %, the target) hit.
    "prefix_caching": (["--requests", "10", "--prefix", "8", "--suffix", "2", "--new-tokens",
                        "1", "--block-size", "4", "--models", "llama"], True),
    "offload": (["--requests", "3", "--prompt", "8", "--new-tokens", "8", "--block-size", "4",
                 "--device-blocks", "12", "--paused-blocks", "1", "--host-blocks", "8",
                 "--max-tokens", "16", "--prefixes", "2", "--prefix-blocks", "2", "--suffix",
                 "2", "--prefix-requests", "4", "--prefix-new-tokens", "1",
                 "--prefix-device-blocks", "12", "--prefix-host-blocks", "4"], True),
    "engine_throughput": (["--requests", "2", "--new-tokens", "2", "--repeats", "1",
                           "--warmup", "0"], True),
    "async_scheduling": (["--requests", "2", "--new-tokens", "2", "--repeats", "1"], False),
    "engine_add_request": (["--queued", "1", "--batch", "2", "--repeats", "1"], False),
    "speculative": (["--requests", "1", "--prompt", "8", "--new-tokens", "3", "--hidden", "32",
                     "--layers", "1", "--repeats", "0", "--workloads", "random"], True),
    "fp8_kv": (["--seq", "24", "--sequences", "1", "--layers", "1", "--hidden", "32",
                "--heads", "2", "--kv-heads", "1", "--vocab", "64", "--requests", "3",
                "--prompt", "16", "--new-tokens", "1"], True),
    "kv_groups": (["--layers", "6", "--window", "8", "--block", "4", "--tokens", "64",
                   "--chunk", "16", "--decode", "4"], True),
}


@pytest.mark.parametrize("script", sorted(BENCHES))
def test_a_bench_writes_only_where_json_points(script, tmp_path, monkeypatch):
    module = __import__(script)  # bench/ is on the tests' path (pyproject)
    argv, takes_json = BENCHES[script]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = checkout_files()
    assert succeeded(module.main(argv))
    assert list(work.iterdir()) == []
    if takes_json:
        target = tmp_path / "results.json"
        assert succeeded(module.main(argv + ["--json", str(target)]))
        assert json.loads(target.read_text())
        assert list(work.iterdir()) == []
        assert sorted(tmp_path.iterdir()) == [target, work]
    assert checkout_files() == before


def test_the_soak_runs_from_the_tests_folder():
    result = subprocess.run([sys.executable, "-P", str(ROOT / "tests" / "context" / "soak.py"),
                             "--steps", "30", "--seeds", "0", "--configs", "bs4-paused4"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 violations" in result.stdout
