"""First contact with a GPU: the paths no GPU has run yet, one JSON line per check.

Section 2 of ``bench/device_check.sh``. Each check writes one line to ``--out`` (JSON:
``check``, ``status`` = passed / failed / skipped / timed_out / killed, ``seconds``, ``summary``
(one line), ``details``, ``gpu``, and for a failure ``error`` and the last lines of its
``traceback``). The checks live in ``bench/device_smoke_checks.py`` (engine and kernels),
``bench/device_smoke_memory.py`` (memory) and ``bench/device_smoke_steps.py`` (kernels and
speculative), each module's ``CHECK_FUNCTIONS``; this script runs them, each against a reference
(transformers' greedy tokens, a kernel's ``_ref``, a float64 attention, a CPU context), never
only "it ran":

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
* ``host_pool_copies``: the host block pool (``dynctx.context.host_pool``) saves blocks (fp32,
  bf16, fp8; K/V and MLA layouts) written behind a busy kernel and loads them into other blocks
  behind another, and a hybrid's Mamba states: byte-equal, other blocks untouched; on CUDA the
  pool is pinned and copies on a side stream (whether save returned before its copy ran is
  recorded).
* ``kv_offload``: a Llama under block pressure with KV offload and the prefix cache's host tier,
  a busy kernel after every step: evictions swapped out and back, prefix blocks spilled and
  restored; tokens = the engine without offload = transformers'.
* ``mamba_offload``: the same on a NemotronH (Mamba states swapped with their requests,
  snapshots spilled and restored by the host tier).
* ``kv_groups``: Gemma 3 (5 sliding + 1 full) and Mistral (every layer windowed) under pressure
  with ``kv_groups``, eager and graphs: tokens = one group's = transformers', a windowed group
  holds fewer blocks than group 0, none held at the end.
* ``speculative_rewind``: the kernel in fp32/fp16/bf16 and bf16 conv + fp32 SSM states,
  contiguous and strided intermediates, with and without ``all_rows``: bit-exact against
  ``speculative_rewind_ref``; captured in a graph and replayed on new inputs = eager.
* ``launch_plans``: 30 paged attention and ``last_token_logits`` calls (decode across split
  counts, mixed steps) with launch plans on and off: bit-equal, plans reused and varied; the
  outputs within tolerance of the torch path; a planned launch captured in a graph = eager.
* ``megatron019_trio``: Megatron-Core 0.19's ``resolve_requests`` / ``prepare_requests`` /
  ``commit_sampled_tokens`` (or, every other step, the step built first and
  ``copy_async_sched_sample_to_forward`` of device tokens into it), k = 0 and 2, behind a busy
  kernel give ``update_requests``' rows and token arrays, read on a side stream after the
  bookkeeping event (no megatron imported).
* ``speculative_modes``: k = 3 drafts (accepted in part) in eager, graphs, async and both:
  tokens = transformers', decode graphs replayed, rewinds deferred under async; a NemotronH
  under async scheduling too (its Mamba states rewound on the device).
* ``draft_model``: ``DraftModelDrafter`` with a nudged copy of the target, eager and async:
  tokens = transformers', drafts accepted and rewound; syncs per draft step recorded.
* ``fp8_kv``: ``kv_append`` into e4m3/e5m2 caches bit-exact against ``kv_append_ref``; paged
  attention over an e4m3 cache against the float64 reference of the dequantized cache; the
  engine with ``kv_cache_dtype="fp8"`` (kernels' path) within 0.02 of the torch FP8 path's
  prompt log probs; FlashInfer's FP8 path against torch where FlashInfer is installed.

Checks are isolated: ``--jobs`` worker processes (default 2; ``device_check.sh`` gives 4, one
per group: engine, kernels, memory, speculative) each run their checks in turn, one failing check
(its exception caught) does not stop the others, a check module that does not import fails its
own checks only, and a worker that dies (a CUDA fault poisons its process) is replaced by a new
one for the checks it had not reached. This process imports no torch: it only spawns the
workers, writes their lines as they come, and when ``--max-seconds`` is spent, or it is sent
SIGTERM (``timeout`` at the section's budget), writes a ``timed_out`` / ``killed`` line for each
check that did not finish. Exit status 0 when no check failed.

Budget: the smoke section of ``device_check.sh`` gets 90 s of the script's 450 (the device tool
lends 15 minutes, the machine's start included, so that one rerun fits), and passes
``--max-seconds`` 86: every check must finish within it, in 4 workers, Triton compiles included.
A check past it is written ``timed_out`` and the lines already written stay.
``DYNCTX_SMOKE_ABSENT`` (comma-separated modules, e.g. ``megatron,flashinfer``) makes them
unimportable in the workers: the dry run sets it, so a check that needs a module the GPU
machine's image lacks fails on the CPU first.

On a CPU (``--device cpu``, the CI dry run of the device check) every check runs its code on
CPU tensors: graphs by the engine's stand-in runner or a plain call, no busy kernel, paged
attention through the Triton interpreter when ``TRITON_INTERPRET=1`` (bf16 skipped: the
interpreter has no bf16 arithmetic), else the torch reference. Its numbers mean nothing there;
the 18 checks take about 40 s (one worker, a loaded 2-core machine).

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
    ("host_pool_copies", "memory"),
    ("kv_offload", "memory"),
    ("mamba_offload", "memory"),
    ("kv_groups", "memory"),
    ("speculative_rewind", "kernels"),
    ("launch_plans", "kernels"),
    ("megatron019_trio", "kernels"),
    ("speculative_modes", "speculative"),
    ("draft_model", "speculative"),
    ("fp8_kv", "speculative"),
)
CHECK_NAMES = tuple(name for name, _ in CHECKS)
#: The modules of bench/ that hold the checks, each with its ``CHECK_FUNCTIONS``.
CHECK_MODULES = ("device_smoke_checks", "device_smoke_memory", "device_smoke_steps")


def _emit(kind: str, payload) -> None:
    sys.stdout.write(f"{MARK}{kind} {json.dumps(payload, default=str)}\n")
    sys.stdout.flush()


def _tail(text: str, lines: int = TRACEBACK_LINES) -> List[str]:
    return [line for line in text.rstrip().splitlines()[-lines:]]


def run_check(checks, functions: dict, env, name: str) -> dict:
    """Check ``functions[name]`` as its line (``checks``: device_smoke_checks, whose
    exceptions say skipped or failed)."""
    started = time.perf_counter()
    record = dict(check=name, device=str(env.device), gpu=env.gpu)
    try:
        summary, details = functions[name](env)
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


#: Comma-separated top-level modules the workers refuse to import: the dry run names those
#: the GPU machine's image lacks (megatron, flashinfer), so that no check depends on them.
ABSENT_ENV = "DYNCTX_SMOKE_ABSENT"


class _Absent:
    """A meta path finder that makes the named top-level modules (and their submodules)
    unimportable, as on a machine without them."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} ({ABSENT_ENV} blocks it)",
                                      name=fullname)
        return None


def block_imports(spec: str) -> List[str]:
    """Make the comma-separated top-level modules of ``spec`` unimportable in this process;
    returns their names."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if names:
        sys.meta_path.insert(0, _Absent(names))
    return names


def _unimported(error: str):
    """The function of a check whose module did not import: it raises that import's error."""
    def check(env):
        raise ImportError(error)
    return check


def worker_main(device: str, names: List[str]) -> int:
    # Under -P bench/ is not on sys.path; torch, transformers and dynctx load here, in the
    # worker (an import that fails is every pending check's line, with its traceback).
    sys.path.insert(0, str(BENCH))
    block_imports(os.environ.get(ABSENT_ENV, ""))
    import importlib

    import device_smoke_checks as checks

    functions, broken = dict(checks.CHECK_FUNCTIONS), []
    for module in CHECK_MODULES[1:]:
        try:
            functions.update(importlib.import_module(module).CHECK_FUNCTIONS)
        except Exception as exc:  # its checks fail with this traceback; the others still run
            broken.append(f"bench/{module}.py did not import ({type(exc).__name__}: {exc})\n"
                          f"{traceback.format_exc()}")
    extra = sorted(set(functions) - set(CHECK_NAMES))
    if extra or (set(CHECK_NAMES) - set(functions) and not broken):
        raise RuntimeError(f"CHECKS and the modules' CHECK_FUNCTIONS disagree: "
                           f"{sorted(set(CHECK_NAMES) ^ set(functions))}")
    for name in set(CHECK_NAMES) - set(functions):
        functions[name] = _unimported("\n".join(broken))
    env = checks.Env(device)
    for name in names:
        _emit("start", name)
        record = run_check(checks, functions, env, name)
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
    absent = os.environ.get(ABSENT_ENV, "").strip()
    print(f"[smoke] {len(args.checks)} checks on {args.device} in {len(groups)} worker(s): "
          + " | ".join(",".join(g) for g in groups), flush=True)
    if absent:
        print(f"[smoke] the workers refuse to import: {absent} ({ABSENT_ENV})", flush=True)
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
