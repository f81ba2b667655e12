"""bench/device_check.sh in its CPU dry run (``--dry``), and bench/device_smoke.py's runner.

The dry run goes through every section's own code with tiny sizes: the link-tree install, the
smoke checks on CPU tensors, one compiled-kernel and the CUDA e2e test files under the
interpreter (the gpu cases skip), the engine bench on the tiny model, tuning (refused without a
GPU). Its engine section is given an endless workload and killed at its 45 s budget, and the
attention section a budget under its floor: what a killed section wrote must still be there, a
skipped one must say why, and the table must come last. Budgets are widened for the other
sections (a loaded CPU is slow to import torch); the GPU's own budgets are the script's
defaults, which the last test checks add up to 450 s."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import device_smoke  # bench/, on sys.path through pyproject's pytest `pythonpath`
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.sh"
SECTIONS = ["versions", "smoke", "kernels", "e2e", "engine", "attention", "tune"]
KILLED_ENGINE_BUDGET = 45
# The files the device tool may bring back: at most 8; the script keeps to 7.
MAX_FILES = 7


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, **extra)
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_out")
    env = _env(
        OUT=str(out), DYNCTX_DEVICE_BUDGET_S="3000",
        DYNCTX_DEVICE_BUDGETS=f"versions=120,smoke=400,kernels=300,e2e=300,"
                              f"engine={KILLED_ENGINE_BUDGET},attention=10",
        # Far more runs than 45 s allow: the section is killed at its budget.
        DYNCTX_DEVICE_ENGINE_ARGS="--max-seconds 100000 --batches "
                                  + ",".join(str(1 + i % 4) for i in range(200)))
    proc = subprocess.run(["bash", str(SCRIPT), "--dry"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    return proc, out


def _table(summary: str) -> dict:
    """``{section: (status, used, budget)}`` from the summary's section table."""
    rows = {}
    for line in summary.splitlines():
        match = re.match(r"^(\w+)\s+(.*?)\s+(\d+)s\s+(\d+)s\s+(\d+)s$", line)
        if match and match.group(1) in SECTIONS:
            rows[match.group(1)] = (match.group(2), int(match.group(3)), int(match.group(4)))
    return rows


def test_dry_run_statuses_budgets_and_the_table_last(dry_run):
    proc, out = dry_run
    summary = (out / "summary.txt").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip()), proc.stdout[-3000:]
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])  # a section was killed
    rows = _table(summary)
    assert list(rows) == SECTIONS, summary
    for name in ("versions", "smoke", "kernels", "e2e"):
        assert rows[name][0] == "passed", summary
    assert rows["engine"][0] == f"killed at its budget ({KILLED_ENGINE_BUDGET}s)", summary
    assert re.match(r"skipped: under its 15s floor \(10s for it, \d+s left\)$",
                    rows["attention"][0]), summary
    assert rows["tune"][0].startswith("skipped: refused: no CUDA GPU"), summary
    for name, (status, used, budget) in rows.items():
        assert used <= budget + 1, f"{name} ran {used} s on a budget of {budget} s"
    assert "up to 0s" not in (out / "device_check.log").read_text()


def test_dry_run_files_and_the_killed_sections_partial_results(dry_run):
    proc, out = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= MAX_FILES, files
    assert files == ["autotune_cache.tar", "device_check.log", "engine_graphs.json",
                     "smoke.jsonl", "summary.txt", "tests.log"], files
    # The killed engine bench: its JSON as it stood at the kill, written once the model was
    # built (params) and again after every run done by then (how many depends on the
    # machine's load: none when importing torch and transformers took the whole budget).
    engine = json.loads((out / "engine_graphs.json").read_text())
    assert engine["versions"]["torch"] and engine["gpu"] is None and engine["params"] > 0
    assert "total_s" not in engine and len(engine["runs"]) < 800  # it never finished
    for run in engine["runs"]:
        assert "error" not in run and run["decode_tokens"] > 0, run
    summary = (out / "summary.txt").read_text()
    assert "-- engine (engine_graphs.json)" in summary
    # The tuned configs (none tuned without a GPU: the committed seed) are packed.
    with tarfile.open(out / "autotune_cache.tar") as tar:
        names = tar.getnames()
    assert any(re.match(r"autotune_cache/[^/]+/\w+\.json$", n) for n in names), names


def test_dry_run_smoke_lines_and_pytest_sections(dry_run):
    proc, out = dry_run
    lines = [json.loads(line) for line in (out / "smoke.jsonl").read_text().splitlines()]
    assert sorted(r["check"] for r in lines) == sorted(device_smoke.CHECK_NAMES)
    for record in lines:
        assert record["status"] == "passed", record
        assert record["device"] == "cpu" and record["summary"]
    by_name = {r["check"]: r for r in lines}
    assert by_name["engine_modes"]["details"]["graphs"]["graph_replays"] > 0
    assert set(by_name["engine_syncs"]["details"]) >= {"eager", "graphs", "async",
                                                       "graphs_async", "goal_met"}
    # The new paths ran, not only passed: pressure, replays, plans reused, references met.
    offload = by_name["kv_offload"]["details"]["offload_and_host_tier"]
    assert offload["kv_offload_restored_requests"] and offload["kv_offload_prefix_restored_blocks"]
    assert by_name["mamba_offload"]["details"]["offload_and_host_tier"][
        "kv_offload_prefix_restored_snapshots"] > 0
    assert by_name["kv_groups"]["details"]["gemma3_graphs"]["graph_replays"] > 0
    assert by_name["speculative_modes"]["details"]["graphs"]["replays"]["decode"] > 0
    assert by_name["speculative_modes"]["details"]["async"]["defer_kv_rewind"] > 0
    assert by_name["draft_model"]["details"]["eager"]["rewound_tokens"] > 0
    plans = by_name["launch_plans"]["details"]
    assert plans["with_plans"]["attention_hits"] and plans["with_plans"]["attention_varied"]
    assert max(plans["max_abs_error_vs_ref"].values()) <= 5e-5
    assert by_name["megatron019_trio"]["details"]["k2"]["mismatched_steps"] == []
    assert by_name["fp8_kv"]["details"]["engine"]["cache_dtype"] == "float8_e4m3fn"
    assert by_name["fp8_kv"]["details"]["flashinfer"]["status"].startswith("absent")
    # The workers refused megatron and flashinfer, as the GPU machine's image lacks them.
    assert "[smoke] the workers refuse to import: megatron,flashinfer" in \
        (out / "device_check.log").read_text()
    tests = (out / "tests.log").read_text()
    assert "=== section kernels: pytest -v" in tests and "=== section e2e: pytest -v" in tests
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^-- kernels tests \(tests.log\): \d+ passed", summary, re.M), summary
    assert re.search(r"^-- e2e tests \(tests.log\): .*skipped", summary, re.M), summary


def test_collect_refuses_the_results_of_a_run_without_a_gpu(dry_run):
    _, out = dry_run
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device_collect.sh"), str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "names a GPU" in proc.stderr and "nothing collected" in proc.stderr


def test_the_gpu_budgets_fit_450_s_and_leave_tuning_30():
    text = SCRIPT.read_text()
    budgets = dict(re.findall(r"\[(\w+)\]=(\d+)", text.split("declare -A BUDGET=")[1]
                              .split(")")[0]))
    floors = dict(re.findall(r"\[(\w+)\]=(\d+)", text.split("declare -A FLOOR=")[1]
                             .split(")")[0]))
    assert list(budgets) == list(floors) == SECTIONS
    total = int(re.search(r"DYNCTX_DEVICE_BUDGET_S:-(\d+)", text).group(1))
    reserve = int(re.search(r"^RESERVE=(\d+)", text, re.M).group(1))
    fixed = sum(int(v) for k, v in budgets.items() if k != "tune")
    assert total == 450 and total - fixed - reserve >= int(floors["tune"]) == 30
    assert all(int(floors[k]) <= int(budgets[k]) for k in SECTIONS if k != "tune")


@pytest.mark.parametrize("value,message", [
    ("DYNCTX_DEVICE_BUDGETS=kernels", "is not SECTION=SECONDS"),
    ("DYNCTX_DEVICE_BUDGETS=fast=3", "is not SECTION=SECONDS"),
    ("DYNCTX_DEVICE_SECTIONS=smoke,sanitizer", "no section 'sanitizer'"),
])
def test_bad_knobs_are_refused_before_anything_runs(tmp_path, value, message):
    name, _, setting = value.partition("=")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry"], cwd=ROOT,
                          env=_env(OUT=str(tmp_path), **{name: setting}),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr
    assert not list(tmp_path.iterdir())


def test_smoke_groups_split_by_worker():
    names = list(device_smoke.CHECK_NAMES)
    assert device_smoke.plan_groups(names, 1) == [names]
    group = {g: [n for n, h in device_smoke.CHECKS if h == g]
             for g in ("engine", "kernels", "memory", "speculative")}
    assert sum(map(len, group.values())) == len(names) == 18
    assert device_smoke.plan_groups(names, 4) == list(group.values())
    assert device_smoke.plan_groups(names, 2) == [group["engine"] + group["memory"],
                                                  group["kernels"] + group["speculative"]]
    assert device_smoke.plan_groups(["pinned_ring", "engine_cuda"], 8) == [["engine_cuda"],
                                                                          ["pinned_ring"]]


def test_smoke_workers_refuse_the_absent_modules():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import device_smoke\n"
            "print(device_smoke.block_imports(' megatron, flashinfer,'))\n"
            "import json\n"   # any other module still imports
            "for name in ('megatron.core.inference', 'flashinfer'):\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except ModuleNotFoundError as exc:\n"
            "        print(exc)\n")
    proc = subprocess.run([sys.executable, "-P", "-c", code, str(ROOT / "bench")], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "['megatron', 'flashinfer']",
        "No module named 'megatron' (DYNCTX_SMOKE_ABSENT blocks it)",
        "No module named 'flashinfer' (DYNCTX_SMOKE_ABSENT blocks it)"]


def _smoke(tmp_path, *argv):
    out = tmp_path / "smoke.jsonl"
    return out, [sys.executable, "-P", str(ROOT / "bench" / "device_smoke.py"), "--device", "cpu",
                 "--out", str(out), *argv]


def _lines(out: Path) -> list:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_smoke_writes_a_line_for_every_check_when_its_time_is_spent(tmp_path):
    out, cmd = _smoke(tmp_path, "--jobs", "1", "--max-seconds", "0.5")
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = _lines(out)
    assert [r["check"] for r in lines] == list(device_smoke.CHECK_NAMES)
    assert {r["status"] for r in lines} == {"timed_out"}
    assert "--max-seconds 0.5 spent" in lines[0]["summary"]


def test_smoke_killed_by_sigterm_writes_the_unfinished_checks(tmp_path):
    out, cmd = _smoke(tmp_path, "--checks", "pull_bookkeeping,pinned_ring")
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("[smoke] 2 checks on cpu")
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 124
    lines = _lines(out)
    assert sorted(r["check"] for r in lines) == ["pinned_ring", "pull_bookkeeping"]
    assert {r["status"] for r in lines} <= {"killed", "passed"} and \
        any(r["status"] == "killed" for r in lines)


class _FakeWorkers(device_smoke.Smoke):
    """Workers that stand in for the real ones: the first dies (exit 3, a lost CUDA context)
    during its first check, the second runs the checks left."""

    FAKE = """
import json, sys
names, first = sys.argv[1].split(","), sys.argv[2] == "1"
for name in names:
    print("@@smoke start " + json.dumps(name), flush=True)
    if first:
        print("Traceback: an illegal memory access", file=sys.stderr)
        sys.exit(3)
    print("@@smoke result " + json.dumps(dict(check=name, status="passed", summary="ok",
                                              seconds=0.1)), flush=True)
"""

    def __init__(self, args):
        super().__init__(args)
        self.spawned = 0

    def worker_command(self, names):
        self.spawned += 1
        return [sys.executable, "-c", self.FAKE, ",".join(names), str(self.spawned)]


def test_smoke_replaces_a_worker_that_dies_and_records_the_check_it_was_running(tmp_path):
    args = device_smoke.parse_args(["--out", str(tmp_path / "s.jsonl"), "--checks",
                                    "engine_cuda,engine_modes,engine_syncs"])
    smoke = _FakeWorkers(args)
    smoke.run_group(args.checks)
    assert smoke.spawned == 2
    by_name = {r["check"]: r for r in _lines(tmp_path / "s.jsonl")}
    assert by_name["engine_cuda"]["status"] == "failed"
    assert "exited with code 3" in by_name["engine_cuda"]["error"]
    assert by_name["engine_cuda"]["traceback"] == ["Traceback: an illegal memory access"]
    assert by_name["engine_modes"]["status"] == by_name["engine_syncs"]["status"] == "passed"


@pytest.mark.parametrize("argv,message", [
    (["--checks", "engine_cuda,nope"], "unknown ['nope']"),
    (["--jobs", "0"], "--jobs=0 must be >= 1"),
    (["--max-seconds", "0"], "--max-seconds=0.0 must be > 0"),
])
def test_smoke_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        device_smoke.parse_args(argv)
    assert message in capsys.readouterr().err
