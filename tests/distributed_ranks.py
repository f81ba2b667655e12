"""Run a function on several spawned CPU ranks joined in one gloo process group.

``run_spawned(target, world_size=2, args=(), timeout_s=...)`` starts ``world_size`` fresh Python
processes (``multiprocessing``'s spawn: nothing of the parent's state, threads or CUDA is
inherited), each with ``OMP_NUM_THREADS=1``, one torch thread and ``python -P`` semantics
(spawn passes the parent's ``-P``; ``PYTHONSAFEPATH=1`` is set as well, and the child checks
``sys.flags.safe_path``: the checkout's ``kernels/`` folder must not be importable under a bare
name). The ranks join a gloo group through a file store in a temporary folder (no port to
race for), run ``target(*args)`` and send back what it returns (small, picklable).

Returns ``{rank: result}``. A rank that raises sends its traceback: ``run_spawned`` raises
``RuntimeError`` with every failing rank's traceback, after stopping the other ranks (which
may wait in a collective the failed rank never joins). A rank still running after
``timeout_s`` seconds is killed and ``TimeoutError`` names it: a hung collective cannot hang
the test run.

Success is every rank's result: a rank that sent its result and then crashed in the
interpreter's teardown (a torch/gloo exit problem, not the target's) does not fail the run.

``target`` must be importable by the child (a module-level function of a module on the
parent's ``sys.path``, which spawn hands to the child).
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Sequence

# After a rank failed, how long the others get to finish before they are stopped.
GRACE_AFTER_FAILURE_S = 3.0


def _child(target: Callable, rank: int, world_size: int, init_method: str, queue: Any,
           args: Sequence[Any], timeout_s: float) -> None:
    try:
        if not sys.flags.safe_path:
            raise RuntimeError("the rank runs without python -P (sys.flags.safe_path is 0)")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = target(*args)
            # Free what the target left in reference cycles (engines hold the process group)
            # before the group goes, then leave together. (A failed rank skips this; its peers
            # are stopped.)
            gc.collect()
            dist.barrier()
        finally:
            dist.destroy_process_group()
        # A result the queue cannot send (a process group, an engine) fails here, with its
        # traceback, not later as a rank "without a result".
        pickle.dumps(result)
    except BaseException:  # noqa: BLE001 - the parent raises it with the traceback
        queue.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    queue.put(("ok", rank, result))


def run_spawned(target: Callable, *, world_size: int = 2, args: Sequence[Any] = (),
                timeout_s: float = 120.0) -> Dict[int, Any]:
    """``{rank: target(*args)}`` over ``world_size`` spawned gloo ranks (module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    saved = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "PYTHONSAFEPATH")}
    os.environ.update(OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    try:
        with tempfile.TemporaryDirectory(prefix="dynctx-ranks-") as tmp:
            init_method = "file://" + os.path.join(tmp, "store")
            procs = [ctx.Process(target=_child, name=f"rank{rank}",
                                 args=(target, rank, world_size, init_method, queue,
                                       tuple(args), timeout_s))
                     for rank in range(world_size)]
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + timeout_s
            failed_at = None

            def drain() -> None:
                while not queue.empty():
                    kind, rank, payload = queue.get()
                    (results if kind == "ok" else errors)[rank] = payload

            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if now > deadline:
                    break
                if errors and failed_at is None:
                    failed_at = now
                if failed_at is not None and now > failed_at + GRACE_AFTER_FAILURE_S:
                    break
                time.sleep(0.05)
                drain()
            # A rank that already reported (its error or its result) and is still tearing down
            # is not one that was stopped: under load its exit can outlast the grace period.
            reported = {f"rank{rank}" for rank in (*errors, *results)}
            hung = [p.name for p in procs if p.is_alive() and p.name not in reported]
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            drain()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    codes = {p.name: p.exitcode for p in procs}
    reports = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))
    if errors:
        raise RuntimeError(f"ranks {sorted(errors)} failed (exit codes {codes}; ranks "
                           f"{hung} stopped after the failure)\n{reports}")
    if hung:
        raise TimeoutError(f"ranks {hung} still running after timeout_s={timeout_s}; exit "
                           f"codes {codes}")
    missing = [rank for rank in range(world_size) if rank not in results]
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result (exit codes {codes})")
    return results
