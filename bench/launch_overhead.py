"""Host microseconds per launch of every launcher, with the final CUDA launch stubbed.

On any machine, GPU or not: the compile-only driver of ``kernels/stub_driver.py`` reports an
sm_90 target, so each launcher runs its whole host path on CPU tensors (argument checks, the
tuned-config lookup, the grid, Triton's dispatch: binding, specialisation, the kernel-cache
lookup) and only the driver's launch call is a no-op. Beside them, the floor: an empty Triton
kernel's dispatch through the same stub, and each launcher's own Triton dispatch (the same
kernel calls with the same arguments, replayed without the launcher: what a launch costs before
any of ours). Each launcher is called as its registered tuning's scratch case calls it (the
first preset key, its counts made small, ``config=None``, as the context calls it), with the
same arguments every time. A repeat launch replays its key's launch plan
(``kernels/launch_plan.py``): found by the C++ guard of the recent plans, the compiled kernel
called directly, so ``launch`` is the whole host cost and may come in under Triton's own
dispatch (``ours``, launch minus dispatch, is then negative); ``lru only`` is the same launch
with that guard off (the plan found by its key built in Python, as on a torch without the
guard); ``no plan`` is a launch with the plans emptied first (the full path, as a new key
takes). The lookup alone is timed too, cached and with the cache emptied before every call.

Timings are this thread's CPU time (``time.thread_time_ns``, so that waiting for a core on a
shared machine does not count), the minimum over ``--repeats`` runs of ``--calls`` calls.
The first call of each launcher compiles its kernel for sm_90 (a few seconds each).

    python -P bench/launch_overhead.py                 # the table
    python -P bench/launch_overhead.py --json out.json
    python -P bench/launch_overhead.py --kernel kv_append --kernel step_metadata
    python -P bench/launch_overhead.py --decode-loop 200 --layers 32   # see decode_loop
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from dynctx.kernels import autotune, registry
from dynctx.kernels.backend import HAS_TRITON, triton_interpreting

try:
    from dynctx.kernels import launch_plan
    from dynctx.kernels.launch_plan import clear_plans
except ImportError:  # a checkout from before launch plans, timed for a --baseline
    launch_plan = None

    def clear_plans() -> None:
        return None

# The launcher of each tuning whose name is not the launcher's own.
LAUNCHER_OF = {"paged_attention_decode": "paged_attention",
               "paged_attention_varlen": "paged_attention"}
# Counts of each key made small: the host path does not depend on them (the grid aside).
SMALL_COUNTS = {"num_tokens": 4, "num_requests": 4, "num_rows": 4, "max_seqlen_k": 300}


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Minimum over ``repeats`` runs of the mean CPU µs of one of ``calls`` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time_ns() - start) / calls / 1000.0)
    return best


def recorded_dispatch(launch):
    """The Triton kernel calls one ``launch()`` makes, as a function that replays them (the
    launch plans emptied first: a planned launch calls no ``JITFunction.run``)."""
    from triton.runtime.jit import JITFunction

    calls, original = [], JITFunction.run
    clear_plans()

    def recording(self, *args, grid, warmup, **kwargs):
        calls.append((self, args, grid, dict(kwargs)))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = recording
    try:
        launch()
    finally:
        JITFunction.run = original

    def replay():
        for fn, args, grid, kwargs in calls:
            original(fn, *args, grid=grid, warmup=False, **kwargs)
    return replay


def recorded_call(tuning, case):
    """The launcher call ``case.run(None)`` makes, as a function that repeats it with the same
    arguments (so the case's own argument building, views of its buffers, is not timed)."""
    launcher, args, kwargs = recorded_arguments(tuning, case)
    return lambda: launcher(*args, **kwargs)


def recorded_arguments(tuning, case):
    """``(launcher, args, kwargs)`` of the launcher call ``case.run(None)`` makes."""
    import importlib

    module = importlib.import_module(tuning.make_case.__module__)
    name = LAUNCHER_OF.get(tuning.name, tuning.name)
    launcher, calls = getattr(module, name), []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return launcher(*args, **kwargs)

    setattr(module, name, recording)
    try:
        case.run(None)
    finally:
        setattr(module, name, launcher)
    if len(calls) != 1:
        raise RuntimeError(f"{tuning.name}: its case called {name} {len(calls)} times, not once")
    (args, kwargs), = calls
    return launcher, args, kwargs


def small_key(key: dict) -> dict:
    return {k: min(v, SMALL_COUNTS[k]) if k in SMALL_COUNTS else v for k, v in key.items()}


def measure(calls: int, repeats: int, kernels: list[str] | None = None) -> dict:
    import triton

    from dynctx.kernels.stub_driver import stub_driver

    @triton.jit
    def _empty_kernel():
        pass

    registry.import_kernel_modules(quiet=True)
    rows = []
    with stub_driver(record_launches=False):
        _empty_kernel[(1,)]()
        floor = per_call_us(lambda: _empty_kernel[(1,)](), calls, repeats)
        for tuning in registry.select_tunings(kernels):
            key = small_key(tuning.presets()[0])
            case = tuning.make_case(key, torch.device("cpu"))
            case.run(None)  # compiles
            call = recorded_call(tuning, case)
            launch = per_call_us(call, calls, repeats)

            def unplanned():
                clear_plans()
                call()

            launch_unplanned = per_call_us(unplanned, max(1, calls // 10), repeats)
            launch_lru = None
            if getattr(launch_plan, "GUARDS", None) is not None:
                guards, launch_plan.GUARDS = launch_plan.GUARDS, None
                try:
                    clear_plans()
                    call()
                    launch_lru = per_call_us(call, calls, repeats)
                finally:
                    launch_plan.GUARDS = guards
                    clear_plans()
                    call()
            dispatch = per_call_us(recorded_dispatch(call), calls, repeats)
            lookup = per_call_us(lambda: autotune.resolve_config(tuning.name, key, "cpu"),
                                 calls, repeats)

            def uncached():
                autotune.clear_lookup_cache()
                autotune.resolve_config(tuning.name, key, "cpu")

            lookup_uncached = per_call_us(uncached, max(1, calls // 10), repeats)
            rows.append({"kernel": tuning.name, "key": registry.key_text(key),
                         "launch_us": round(launch, 2), "over_floor_us": round(launch - floor, 2),
                         "unplanned_us": round(launch_unplanned, 2),
                         "lru_only_us": None if launch_lru is None else round(launch_lru, 2),
                         "dispatch_us": round(dispatch, 2),
                         "over_dispatch_us": round(launch - dispatch, 2),
                         "lookup_us": round(lookup, 2),
                         "lookup_uncached_us": round(lookup_uncached, 2)})
    return {"floor_us": round(floor, 2), "rows": rows, "calls": calls, "repeats": repeats,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__}, "machine": platform.machine()}


def _count_step_calls(steps: int) -> dict:
    """Per step, the kwargs of the count launchers' calls as a serving loop makes them (fixed
    buffers, ``check=False`` as the context calls them, the Triton backend): 48 to 55
    requests, a few joining or leaving every 10 steps, a chunked prefill row every other step
    (1 to 256 tokens), tokens padded to 64 and rows to 8, 0 to 2 paused rows."""
    rows, tokens, max_blocks, vocab = 64, 512, 64, 4096
    gen = torch.Generator().manual_seed(0)
    step_buffers = dict(
        block_table=torch.randint(0, 4096, (rows, max_blocks), generator=gen, dtype=torch.int32),
        query_lengths=torch.ones(rows, dtype=torch.int32),
        kv_offsets=torch.randint(0, 4096, (rows,), generator=gen, dtype=torch.int32),
        cu_query_lengths=torch.arange(rows + 1, dtype=torch.int32),
        next_tokens=torch.zeros(rows, dtype=torch.int64),
        prompt_tokens=torch.zeros(tokens, dtype=torch.int64),
        attn_block_table=torch.zeros(rows, max_blocks, dtype=torch.int32),
        **{name: torch.zeros(tokens, dtype=torch.int64) for name in (
            "token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
            "token_to_block_idx", "token_to_position_in_request",
            "token_to_local_position_within_kv_block")})
    compact_buffers = dict(
        dst_block_table=torch.zeros(rows, max_blocks, dtype=torch.int32),
        src_block_table=torch.zeros(rows, max_blocks, dtype=torch.int32),
        dst_next_tokens=torch.zeros(rows, dtype=torch.int64),
        src_next_tokens=torch.zeros(rows, dtype=torch.int64),
        new_tokens=torch.zeros(rows, dtype=torch.int64),
        plan_src=torch.arange(rows, dtype=torch.int32),
        plan_append_col=torch.full((rows,), -1, dtype=torch.int32),
        plan_append_block=torch.full((rows,), -1, dtype=torch.int32))
    logits = torch.zeros(tokens, vocab, dtype=torch.bfloat16)
    calls = {"step_metadata": [], "compact_requests": [], "last_token_logits": []}
    previous = 48
    for step in range(steps):
        requests = 48 + (step // 10) % 8
        chunk = 1 + (37 * step) % 256 if step % 2 else 0
        decode = requests - 1 if chunk else requests
        active = decode + chunk
        calls["step_metadata"].append(dict(
            step_buffers, num_requests=requests, num_decode=decode, active_tokens=active,
            padded_tokens=-(-active // 64) * 64, padded_requests=-(-requests // 8) * 8,
            row_offset=(step // 25) % 3, block_size=256, dummy_block=4095, check=False,
            backend="triton"))
        calls["compact_requests"].append(dict(
            compact_buffers, new_token_offset=0, num_rows=requests,
            clear_rows=max(requests, previous), check=False, backend="triton"))
        calls["last_token_logits"].append(dict(
            logits=logits, cu_query_lengths=step_buffers["cu_query_lengths"],
            num_requests=requests, backend="triton"))
        previous = requests
    return calls


def decode_loop(steps: int, layers: int, start: int, repeats: int) -> dict:
    """Host µs per decode step of the launchers whose host counts change from step to step.
    Paged attention: ``layers`` calls a step (one per layer, the same lengths),
    ``max_seqlen_k`` from ``start`` growing by one a step, as the decode tuning's scratch case
    calls it (its first preset, counts made small, the block table sized for the last step).
    step_metadata, compact_requests and last_token_logits: one call a step each, over fixed
    buffers, their counts as ``_count_step_calls`` gives them. Three ways, in the same run:
    ``classes``, the plan keys as they are (the counts' classes, kernels/launch_plan.py
    CountPlan and kernels/paged_attention_plan.py); ``exact``, the keys holding the counts
    themselves, as before them (each launcher's classes answering the counts: a new count
    misses); ``no plan``, every call the full path. Each loop starts with the plans emptied;
    per step the minimum over ``repeats`` loops."""
    import importlib

    from dynctx.kernels.stub_driver import stub_driver

    registry.import_kernel_modules(quiet=True)
    # (The modules: dynctx.kernels' own attributes of these names are the launchers.)
    attention, step_module, compaction, logits_module = (
        importlib.import_module(f"dynctx.kernels.{name}") for name in (
            "paged_attention", "step_metadata", "compaction", "last_token_logits"))
    classes = {(attention, "length_classes"): lambda q, k, decode, window: (q, k),
               (step_module, "count_classes"): lambda *counts: counts,
               (compaction, "_row_classes"): lambda *counts: counts,
               (logits_module, "count_class"): lambda count: count}
    tuning = autotune.get_tuning("paged_attention_decode")
    key = dict(small_key(tuning.presets()[0]), max_seqlen_k=start + steps - 1)
    case = tuning.make_case(key, torch.device("cpu"))
    result = {"steps": steps, "layers": layers, "start": start, "repeats": repeats,
              "key": registry.key_text(key), "ways": {}}
    previous = os.environ.get(launch_plan.PLANS_ENV)
    caches = launch_plan.plan_caches()
    with stub_driver(record_launches=False):
        attend, args, kwargs = recorded_arguments(tuning, case)
        per_step = {"paged_attention": [(attend, args, dict(kwargs, max_seqlen_k=start + step),
                                         layers) for step in range(steps)]}
        for name, calls in _count_step_calls(steps).items():
            launcher = getattr(importlib.import_module(f"dynctx.kernels.{name}"
                                                       if name != "compact_requests"
                                                       else "dynctx.kernels.compaction"), name)
            per_step[name] = [(launcher, (), call, 1) for call in calls]
        originals = {place: getattr(*place) for place in classes}
        for way, plans in (("classes", "1"), ("exact", "1"), ("no plan", "0")):
            best = {name: [float("inf")] * steps for name in per_step}
            misses = {}
            os.environ[launch_plan.PLANS_ENV] = plans
            try:
                for (module, attribute), exact in classes.items():
                    setattr(module, attribute, exact if way == "exact" else
                            originals[module, attribute])
                for _ in range(repeats + 1):  # the first loop warms up, untimed
                    clear_plans()
                    start_misses = {name: caches[name].misses for name in per_step}
                    for step in range(steps):
                        for name, calls in per_step.items():
                            launcher, call_args, call_kwargs, times = calls[step]
                            begin = time.thread_time_ns()
                            for _ in range(times):
                                launcher(*call_args, **call_kwargs)
                            elapsed = (time.thread_time_ns() - begin) / 1000.0
                            best[name][step] = min(best[name][step], elapsed)
                    misses = {name: caches[name].misses - start_misses[name]
                              for name in per_step}
            finally:
                for place, original in originals.items():
                    setattr(*place, original)
                if previous is None:
                    os.environ.pop(launch_plan.PLANS_ENV, None)
                else:
                    os.environ[launch_plan.PLANS_ENV] = previous
                clear_plans()
            result["ways"][way] = {}
            for name, times in best.items():
                ordered = sorted(times)
                result["ways"][way][name] = {
                    "step_us_mean": round(sum(times) / steps, 2),
                    "step_us_median": round(ordered[steps // 2], 2),
                    "step_us_max": round(ordered[-1], 2),
                    "call_us_mean": round(sum(times) / steps / per_step[name][0][3], 2),
                    "misses_per_loop": misses[name]}
    return result


def print_decode_loop(result: dict) -> None:
    print(f"decode loop: {result['steps']} steps; paged attention {result['layers']} layers, "
          f"max_seqlen_k {result['start']}..{result['start'] + result['steps'] - 1} "
          f"({result['key']}); the count launchers once a step, their counts changing")
    print(f"{'launcher':<19}{'key':<9}{'step mean':>10}{'median':>9}{'max':>10}{'per call':>9}"
          f"{'misses':>8}   (host CPU us per step)")
    for name in next(iter(result["ways"].values())):
        for way, rows in result["ways"].items():
            row = rows[name]
            print(f"{name:<19}{way:<9}{row['step_us_mean']:>10.2f}{row['step_us_median']:>9.2f}"
                  f"{row['step_us_max']:>10.2f}{row['call_us_mean']:>9.2f}"
                  f"{row['misses_per_loop']:>8}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--kernel", action="append", help="only these tunings (repeatable)")
    parser.add_argument("--baseline", help="a run's --json from before a change: kept in the "
                        "results as 'baseline', its launch column printed as 'before'")
    parser.add_argument("--decode-loop", type=int, metavar="STEPS", help="instead of the table, "
                        "paged attention over STEPS decode steps of a growing max_seqlen_k")
    parser.add_argument("--layers", type=int, default=32, help="calls per decode step")
    parser.add_argument("--start", type=int, default=1000, help="the first step's max_seqlen_k")
    args = parser.parse_args(argv)
    if not HAS_TRITON or triton_interpreting():
        print("launch_overhead: needs triton, compiled (TRITON_INTERPRET unset)", file=sys.stderr)
        return 2
    command = "python -P bench/launch_overhead.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if args.decode_loop:
        result = decode_loop(args.decode_loop, args.layers, args.start, args.repeats)
        result.update(benchmark="launch_overhead decode loop", command=command,
                      load_average=list(os.getloadavg()),
                      versions={"python": platform.python_version(),
                                "torch": torch.__version__,
                                "triton": __import__("triton").__version__},
                      machine=platform.machine())
        print_decode_loop(result)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2, sort_keys=True)
                f.write("\n")
        return 0
    result = measure(args.calls, args.repeats, args.kernel)
    result.update(benchmark="launch_overhead", command=command,
                  load_average=list(os.getloadavg()))
    before = {}
    if args.baseline:
        with open(args.baseline, encoding="utf-8") as f:
            result["baseline"] = json.load(f)
        before = {row["kernel"]: row["launch_us"] for row in result["baseline"]["rows"]}
        print(f"baseline floor: {result['baseline']['floor_us']:.2f} us")
    print(f"empty Triton kernel dispatch (the floor): {result['floor_us']:.2f} us")
    print(f"{'launcher (tuning)':<24}{'before' if before else '':>8}{'launch':>8}{'-floor':>8}"
          f"{'lru only':>9}{'no plan':>8}{'triton':>8}{'ours':>8}{'lookup':>8}{'uncached':>9}"
          "   (host CPU us; ours = launch - triton)")
    for row in result["rows"]:
        previous = f"{before[row['kernel']]:>8.2f}" if row["kernel"] in before else " " * 8
        lru = row.get("lru_only_us")
        print(f"{row['kernel']:<24}{previous}{row['launch_us']:>8.2f}{row['over_floor_us']:>8.2f}"
              f"{'-' if lru is None else f'{lru:.2f}':>9}"
              f"{row['unplanned_us']:>8.2f}{row['dispatch_us']:>8.2f}{row['over_dispatch_us']:>8.2f}"
              f"{row['lookup_us']:>8.2f}{row['lookup_uncached_us']:>9.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
