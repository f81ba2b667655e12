"""Timing of GPU launches under CUDA graphs, for ``autotune tune|bench`` and ``bench/``.

Nothing here runs at inference time: launchers only look configs up (docs/DESIGN.md,
Autotune-and-commit).
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def _capture(fn: Callable[[], object], launches: int) -> Callable[[], None]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return graph.replay  # the bound method keeps the graph alive


def _eager(fn: Callable[[], object], launches: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(launches):
            fn()
    return run


def time_launches(fn: Callable[[], object], *, warmup: int = 10, rep: int = 20,
                  launches: int | None = None, target_ms: float = 1.0,
                  graph: bool = True) -> dict:
    """Median microseconds per call of ``fn`` on the current CUDA device.

    ``warmup`` eager calls (compilation, caches); a probe graph of 10 calls estimates the time
    of one; then a CUDA graph of ``launches`` calls (by default enough for about ``target_ms``,
    20 to 1000) is replayed ``rep`` times, each replay timed with CUDA events. When ``fn``
    cannot be captured (it syncs with the host, say) the same calls run eagerly between the
    events and ``method`` says ``"events"``: then launch overhead is part of the time.
    """
    for _ in range(max(1, warmup)):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def per_call_us(replay: Callable[[], None], calls: int) -> float:
        start.record()
        replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / calls

    method, make = "cuda_graph", _capture
    try:
        if not graph:
            raise RuntimeError("graph=False")
        probe = _capture(fn, 10)
        probe()
        torch.cuda.synchronize()
    except Exception:
        torch.cuda.synchronize()
        method, make = "events", _eager
        probe = _eager(fn, 10)
    estimate_us = per_call_us(probe, 10)
    del probe
    if launches is None:
        launches = int(min(1000, max(20, target_ms * 1000.0 / max(estimate_us, 0.01))))
    replay = make(fn, launches)
    replay()
    torch.cuda.synchronize()
    samples = [per_call_us(replay, launches) for _ in range(max(1, rep))]
    del replay
    return {"us": statistics.median(samples), "method": method, "launches": launches,
            "replays": len(samples)}
