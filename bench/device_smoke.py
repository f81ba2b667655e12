"""First contact with a GPU: the paths no GPU has run yet, one JSON line per check.

Section 2 of ``bench/device_check.sh``. Each check writes one line to ``--out`` (JSON:
``check``, ``status`` = passed / failed / skipped / timed_out / killed, ``seconds``, ``summary``
(one line), ``details``, ``gpu``, and for a failure ``error`` and the last lines of its
``traceback``). The checks live in ``bench/device_smoke_checks.py``; this script runs them:

* ``engine_cuda``: ``Engine.from_transformers(..., device=<--device as given>)`` on a tiny random
  Llama (fp32) builds, generates, and gives transformers' own greedy tokens; it records the
  device the context stores and the attention backend ``"auto"`` chose.
* ``engine_modes``: eager, CUDA graphs, async scheduling, and both together give identical
  tokens (staggered arrivals, chunked prefill), the graph modes replaying captured graphs.
* ``engine_syncs``: host-device syncs per engine step in each of those modes, counted by
  ``bench/step_overhead.py``'s counter (``OverheadCounter``: ``.item()``, readbacks, blocking
  uploads, ...) and, on CUDA, by CUDA's own sync debug mode (``torch.cuda.set_sync_debug_mode``)
  and the event waits; the goal (issue 19 §1) is at most one per synchronous decode step and
  none in async mode. Recorded, not asserted: ``details.goal_met``.
* ``readback_busy``: async scheduling with a busy kernel queued after every step (the sampled
  tokens' pinned read-back lands late): the tokens must equal the synchronous engine's.
* ``paged_attention_dtypes``: ``dynctx.kernels.paged_attention`` in fp32, fp16 and bf16, decode
  and mixed (decode + prefill chunks) steps, against a float64 reference over the block table,
  with NaN in every slot a request must not read.
* ``paged_attention_graph``: the same launcher captured in a ``torch.cuda.CUDAGraph`` (decode
  and mixed), replayed on new values and lengths written in place.
* ``pull_bookkeeping``: bookkeeping tensors written by hand on the device (as Megatron-Core's
  tests do), ``pull_bookkeeping_from_device()``, then an update that sees them; the same on a
  CPU context, compared.
* ``pinned_ring``: a context on the device driven for 20 steps (arrivals, finishes) with a busy
  kernel queued before every step, so that every upload through the pinned staging ring waits
  behind it: every step's arrays must equal a CPU context's.

Checks are isolated: ``--jobs`` worker processes (default 2: the engine checks and the kernel
and context checks) each run their checks in turn, one failing check (its exception caught) does
not stop the others, and a worker that dies (a CUDA fault poisons its process) is replaced by a
new one for the checks it had not reached. This process imports no torch: it only spawns the
workers, writes their lines as they come, and when ``--max-seconds`` is spent, or it is sent
SIGTERM (``timeout`` at the section's budget), writes a ``timed_out`` / ``killed`` line for each
check that did not finish. Exit status 0 when no check failed.

On a CPU (``--device cpu``, the CI dry run of the device check) every check runs its code on
CPU tensors: graphs by the engine's stand-in runner or a plain call, no busy kernel, paged
attention through the Triton interpreter when ``TRITON_INTERPRET=1`` (bf16 skipped: the
interpreter has no bf16 arithmetic), else the torch reference. Its numbers mean nothing there.

    python -P bench/device_smoke.py --out $OUT/smoke.jsonl              # on the GPU
    TRITON_INTERPRET=1 python -P bench/device_smoke.py --device cpu --jobs 1 --out smoke.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

BENCH = Path(__file__).resolve().parent
MARK = "@@smoke "
TRACEBACK_LINES = 12

#: (name, group): the checks in the order they run; a group runs in one worker.
CHECKS = (
    ("engine_cuda", "engine"),
    ("engine_modes", "engine"),
    ("engine_syncs", "engine"),
    ("readback_busy", "engine"),
    ("paged_attention_dtypes", "kernels"),
    ("paged_attention_graph", "kernels"),
    ("pull_bookkeeping", "kernels"),
    ("pinned_ring", "kernels"),
)
CHECK_NAMES = tuple(name for name, _ in CHECKS)


def _emit(kind: str, payload) -> None:
    sys.stdout.write(f"{MARK}{kind} {json.dumps(payload, default=str)}\n")
    sys.stdout.flush()


def _tail(text: str, lines: int = TRACEBACK_LINES) -> List[str]:
    return [line for line in text.rstrip().splitlines()[-lines:]]


def run_check(checks, env, name: str) -> dict:
    """One check of the ``checks`` module (device_smoke_checks) as its line."""
    started = time.perf_counter()
    record = dict(check=name, device=str(env.device), gpu=env.gpu)
    try:
        summary, details = checks.CHECK_FUNCTIONS[name](env)
        env.sync()
        record.update(status="passed", summary=summary, details=details)
    except checks.CheckSkipped as exc:
        record.update(status="skipped", summary=str(exc))
    except Exception as exc:  # every failure becomes the check's line; the next check runs
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:500],
                      traceback=_tail(traceback.format_exc()),
                      details=getattr(exc, "details", {}))
        record["summary"] = record["error"].splitlines()[0][:200]
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def cuda_alive(env) -> bool:
    try:
        env.sync()
        return True
    except Exception:  # an illegal address poisons the CUDA context for good
        return False


def worker_main(device: str, names: List[str]) -> int:
    # Under -P bench/ is not on sys.path; torch, transformers and dynctx load here, in the
    # worker (an import that fails is every pending check's line, with its traceback).
    sys.path.insert(0, str(BENCH))
    import device_smoke_checks as checks

    missing = sorted(set(CHECK_NAMES) ^ set(checks.CHECK_FUNCTIONS))
    if missing:
        raise RuntimeError(f"CHECKS and device_smoke_checks.CHECK_FUNCTIONS disagree: {missing}")
    env = checks.Env(device)
    for name in names:
        _emit("start", name)
        record = run_check(checks, env, name)
        _emit("result", record)
        if record["status"] == "failed" and not cuda_alive(env):
            return 3  # the parent starts a new worker for the checks after this one
    return 0


def plan_groups(names: List[str], jobs: int) -> List[List[str]]:
    """The checks split into at most ``jobs`` workers: by group, groups merged in turn when
    there are more groups than jobs; each list keeps the checks' order."""
    groups: Dict[str, List[str]] = {}
    for name, group in CHECKS:
        if name in names:
            groups.setdefault(group, []).append(name)
    merged: List[List[str]] = [[] for _ in range(min(max(1, jobs), len(groups)))]
    for i, members in enumerate(groups.values()):
        merged[i % len(merged)].extend(members)
    return [sorted(m, key=CHECK_NAMES.index) for m in merged if m]


class Smoke:
    """The parent's state: the lines written, the workers running."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("")
        # Re-entrant: the SIGTERM handler runs on the main thread, which may hold it.
        self.lock = threading.RLock()
        self.closed = False
        self.done: Dict[str, dict] = {}
        self.workers: List[subprocess.Popen] = []
        self.started = time.monotonic()

    def write(self, record: dict) -> None:
        with self.lock:
            if self.closed or record["check"] in self.done:
                return
            self.done[record["check"]] = record
            with self.out.open("a") as f:
                f.write(json.dumps(record, sort_keys=True, default=str) + "\n")
            mark = {"passed": "ok", "skipped": "--"}.get(record["status"], "!!")
            print(f"[smoke] {mark} {record['check']:<24} {record['status']:<9} "
                  f"{record.get('seconds', 0):6.1f}s  {record.get('summary', '')}"[:240],
                  flush=True)

    def close_unfinished(self, status: str, why: str) -> None:
        """A ``status`` line for every check without one, then no more lines; the workers are
        killed (their threads' late lines are dropped)."""
        with self.lock:
            for name in self.args.checks:
                self.write(dict(check=name, status=status, summary=why, seconds=0.0))
            self.closed = True
            workers = list(self.workers)
        for worker in workers:
            if worker.poll() is None:
                worker.kill()

    def worker_command(self, names: List[str]) -> List[str]:
        return [sys.executable, "-P", str(Path(__file__).resolve()), "--worker",
                "--device", self.args.device, "--checks", ",".join(names)]

    def run_group(self, names: List[str]) -> None:
        """Run ``names`` in workers until each has a line (a dead worker is replaced)."""
        pending = list(names)
        while pending:
            stderr = tempfile.TemporaryFile(mode="w+")
            with self.lock:  # no worker starts once closed (close_unfinished kills them all)
                if self.closed:
                    return
                worker = subprocess.Popen(self.worker_command(pending), stdout=subprocess.PIPE,
                                          stderr=stderr, text=True)
                self.workers.append(worker)
            current = None
            for line in worker.stdout:
                if not line.startswith(MARK):
                    continue
                kind, _, payload = line[len(MARK):].partition(" ")
                payload = json.loads(payload)
                if kind == "start":
                    current = payload
                elif kind == "result":
                    self.write(payload)
                    pending.remove(payload["check"])
                    current = None
            code = worker.wait()
            stderr.seek(0)
            errors = _tail(stderr.read())
            stderr.close()
            if current is not None:
                self.write(dict(check=current, status="failed", seconds=0.0,
                                error=f"its worker exited with code {code} while running it",
                                summary=f"worker exited with code {code} during the check",
                                traceback=errors))
                pending.remove(current)
            elif pending and code != 3:  # it died before its first check (an import, say)
                for name in pending:
                    self.write(dict(check=name, status="failed", seconds=0.0,
                                    summary=f"worker exited with code {code} before it",
                                    traceback=errors))
                return


def parent_main(args) -> int:
    smoke = Smoke(args)

    def on_term(signum, frame):
        smoke.close_unfinished("killed", "killed at the section's budget (SIGTERM) before "
                                         "it finished")
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    groups = plan_groups(args.checks, args.jobs)
    print(f"[smoke] {len(args.checks)} checks on {args.device} in {len(groups)} worker(s): "
          + " | ".join(",".join(g) for g in groups), flush=True)
    threads = [threading.Thread(target=smoke.run_group, args=(g,), daemon=True) for g in groups]
    for thread in threads:
        thread.start()
    deadline = smoke.started + args.max_seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        smoke.close_unfinished("timed_out", f"--max-seconds {args.max_seconds:g} spent before "
                                            "it finished")
    statuses = [smoke.done[name]["status"] for name in args.checks]
    passed = statuses.count("passed")
    print(f"[smoke] {passed} of {len(statuses)} passed, "
          f"{len(statuses) - passed - statuses.count('skipped')} not, in "
          f"{time.monotonic() - smoke.started:.1f} s", flush=True)
    return 0 if all(s in ("passed", "skipped") for s in statuses) else 1


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="smoke.jsonl", help="one JSON line per check")
    parser.add_argument("--device", default="cuda",
                        help="the device, as a user writes it (default cuda, unindexed)")
    parser.add_argument("--checks", default=",".join(CHECK_NAMES),
                        help=f"comma-separated subset of {','.join(CHECK_NAMES)}")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-seconds", type=float, default=55.0,
                        help="then every unfinished check is written as timed_out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.checks = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(args.checks) - set(CHECK_NAMES))
    if unknown or not args.checks:
        parser.error(f"--checks: unknown {unknown}; choose from {', '.join(CHECK_NAMES)}")
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} must be >= 1")
    if args.max_seconds <= 0:
        parser.error(f"--max-seconds={args.max_seconds} must be > 0")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.device, args.checks)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
