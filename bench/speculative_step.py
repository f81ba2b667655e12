"""Host time and launches per speculative decode step of the context, k = 0 beside k > 0.

A decode step with ``num_speculative_tokens = k`` is three context calls: the step
(``initialize_attention_state``), the rewind of the rejected drafts (``rewind_kv_cache``, after
the verification) and ``update_requests`` with the next drafts; with ``k = 0`` only the first
and the last (what ``bench/step_overhead.py`` times). The workload is ``step_overhead``'s:
``--requests`` requests of spread prompt lengths (``prompt_lengths``) on its configuration
(``bench_config``), decoding ``--steps`` steps; with ``k > 0`` request ``i`` accepts ``(i +
step) % (k + 1)`` drafts at each step, so rewinds cross block boundaries and release blocks.
The ops and syncs are counted with ``step_overhead.OverheadCounter`` (a launcher call is one
op), the host time is the median over the steps of the best of ``--repeats`` runs.

Usage::

    OMP_NUM_THREADS=1 python bench/speculative_step.py [--requests 64] [--k 0,3] [--json PATH]

``measure(requests=, steps=, k=)`` returns the dict of one ``k``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

# Under -P the script's folder is not on sys.path; its sibling step_overhead is the workload.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_overhead import (  # noqa: E402
    OverheadCounter,
    _context_modules,
    _launcher_timer,
    bench_config,
    prompt_lengths,
)


def _context(requests: int, steps: int, k: int, block_size: int, max_prompt: int):
    from dynctx.context import DynamicInferenceContext

    # Blocks for up to 1 + k tokens a step (step_overhead's sizing of that many steps).
    cfg = bench_config(requests=requests, steps=steps * (1 + k), block_size=block_size,
                       max_prompt=max_prompt, max_tokens=16384)
    return DynamicInferenceContext(**cfg, device="cpu", num_speculative_tokens=k)


def _drafts(k: int, active: int, step: int) -> Optional[torch.Tensor]:
    if not k:
        return None
    # On the device, as the drafter's output is (device= makes the counter see a device tensor).
    return (torch.arange(k * active, dtype=torch.long, device="cpu").view(k, active)
            + step) % 1000


def _prefill(ctx, requests: int, k: int, max_prompt: int, gen: int) -> None:
    from dynctx.context import DynamicInferenceRequest, SamplingParams

    pending = list(enumerate(prompt_lengths(requests, max_prompt)))
    step = 0
    while pending:
        while pending and ctx.active_token_count + pending[0][1] <= ctx.max_tokens:
            rid, length = pending.pop(0)
            ctx.add_request(DynamicInferenceRequest(
                request_id=rid, prompt_tokens=torch.arange(length) % 1000,
                sampling_params=SamplingParams(num_tokens_to_generate=gen)))
        ctx.initialize_attention_state()
        active = ctx.total_request_count - ctx.paused_request_count
        ctx.update_requests(torch.ones(active, dtype=torch.uint8),
                            torch.arange(active, dtype=torch.long) + step,
                            _drafts(k, active, step))
        step += 1
    assert ctx.paused_request_count == 0, "the buffer is too small: requests paused in prefill"


def _inputs(ctx, k: int, steps: int) -> list:
    """Each step's arguments, made before it (the sampler's and drafter's outputs, on the
    device; the accepted counts on the host, where the engine verifies the tokens it read)."""
    active = ctx.total_request_count - ctx.paused_request_count
    rows = ctx.host_request_ids()[ctx.paused_request_count:].astype("int64")
    steps_inputs = []
    for s in range(steps):
        accepted = (rows + s) % (k + 1)   # host memory: kept beside its tensor (the counter)
        steps_inputs.append((torch.ones(active, dtype=torch.uint8, device="cpu"),
                             torch.arange(active, dtype=torch.long, device="cpu") * 7 + s,
                             _drafts(k, active, s), torch.from_numpy(accepted), accepted))
    return steps_inputs


def _step(ctx, k: int, inputs: tuple) -> None:
    """One decode step's context calls (every request kept)."""
    mask, tokens, drafts, accepted, _ = inputs
    ctx.initialize_attention_state()
    if k:
        ctx.rewind_kv_cache(accepted)
    ctx.update_requests(mask, tokens, drafts)


def measure(*, requests: int = 64, steps: int = 30, k: int = 3, block_size: int = 256,
            max_prompt: int = 512, repeats: int = 3) -> dict:
    """Ops, syncs and host seconds per decode step for one ``k`` (one torch thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = _context(requests, steps, k, block_size, max_prompt)
        _prefill(ctx, requests, k, max_prompt, gen=steps * (1 + k) + 8)
        inputs = _inputs(ctx, k, steps)
        counter = OverheadCounter(ctx.device, roots=[ctx, inputs],
                                  launcher_modules=_context_modules())
        ops, syncs = [], []
        for s in range(steps):
            counter.reset()
            with counter.counting():
                _step(ctx, k, inputs[s])
            ops.append(sum(counter.ops.values()))
            syncs.append(sum(counter.syncs.values()))
        best: Optional[List[float]] = None
        best_outside: Optional[List[float]] = None
        for _ in range(repeats):
            ctx = _context(requests, steps, k, block_size, max_prompt)
            _prefill(ctx, requests, k, max_prompt, gen=steps * (1 + k) + 8)
            inputs = _inputs(ctx, k, steps)
            times, outside = [], []
            sink = [0.0]
            gc.disable()
            try:
                with _launcher_timer(_context_modules(), sink):
                    for s in range(steps):
                        sink[0] = 0.0
                        t0 = time.perf_counter()
                        _step(ctx, k, inputs[s])
                        times.append(time.perf_counter() - t0)
                        outside.append(times[-1] - sink[0])
            finally:
                gc.enable()
            best = times if best is None else [min(a, b) for a, b in zip(best, times)]
            best_outside = outside if best_outside is None else [
                min(a, b) for a, b in zip(best_outside, outside)]
        return {"k": k, "requests": requests, "steps": steps, "block_size": block_size,
                "ops_per_step_mean": statistics.mean(ops), "ops_per_step_max": max(ops),
                "syncs_per_step_mean": statistics.mean(syncs),
                "host_us_per_step_median": statistics.median(best) * 1e6,
                "host_us_outside_launchers_median": statistics.median(best_outside) * 1e6,
                "paused_at_end": ctx.paused_request_count}
    finally:
        torch.set_num_threads(threads)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--k", default="0,3", help="num_speculative_tokens values, comma list")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = [measure(requests=args.requests, steps=args.steps, k=int(k),
                    block_size=args.block_size, repeats=args.repeats)
            for k in args.k.split(",")]
    print(f"decode step of the context at {args.requests} requests, block size "
          f"{args.block_size}, one torch thread (k > 0: initialize + rewind + update)")
    print(f"{'k':>3} {'ops/step':>9} {'max':>4} {'syncs':>6} {'host us/step':>13} "
          f"{'outside launchers':>18}")
    for row in rows:
        print(f"{row['k']:>3} {row['ops_per_step_mean']:>9.1f} {row['ops_per_step_max']:>4} "
              f"{row['syncs_per_step_mean']:>6.2f} {row['host_us_per_step_median']:>13.0f} "
              f"{row['host_us_outside_launchers_median']:>18.0f}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"benchmark": "speculative_step", "rows": rows}, indent=2,
                                   sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
