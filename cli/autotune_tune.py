"""``autotune tune``: check every config of every preset key against the torch reference, time
the ones that pass under CUDA graphs, and merge the fastest into ``<out>/<device>/<kernel>.json``.

``--out`` defaults to the override folder the launchers read first: ``$DYNCTX_AUTOTUNE_DIR``
when it is set, else the per-user folder (``autotune.user_cache_dir()``), so that what a run
tunes is used at once and survives a reinstall. ``--out autotune_cache`` in a checkout writes the
packaged files, to commit them (CONTRIBUTING.md, "Tuning kernels and committing configs").
"""

from __future__ import annotations

import copy
import functools
import json
import os
import time
from pathlib import Path

import torch

from dynctx import autotune_runs as runs
from dynctx.kernels import autotune, timing
from dynctx.kernels.autotune import KernelConfig, KernelTuning
from dynctx.kernels.registry import key_text


def default_out_dir() -> tuple[Path, str]:
    """``(folder, why there)``: where ``tune`` writes without ``--out``."""
    override = os.environ.get(autotune.OVERRIDE_ENV)
    if override:
        return Path(override), f"${autotune.OVERRIDE_ENV}, which launchers read first"
    return (autotune.user_cache_dir(), "the per-user folder launchers read first while "
            f"${autotune.OVERRIDE_ENV} is unset")


def read_existing(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return copy.deepcopy(autotune.load_cache_file(path)["entries"])


def merge_write(path: Path, device: str, kernel: str, new_entries: list[dict],
                run_versions: dict) -> None:
    entries = {json.dumps(e["key"], sort_keys=True): e for e in read_existing(path)}
    for entry in new_entries:
        entries[json.dumps(entry["key"], sort_keys=True)] = entry
    autotune.write_cache_file(path, device=device, kernel=kernel, entries=list(entries.values()),
                               versions=run_versions)


def _lost(tuning: KernelTuning, name: str, why: str) -> runs.CudaContextLost:
    return runs.CudaContextLost(f"{tuning.name} {name} broke the CUDA context: {why}")


def tune_key(tuning: KernelTuning, key: dict, device: torch.device, args,
             run_versions: dict) -> tuple[dict | None, dict[str, str]]:
    """Check and time every config for one key; return ``(entry or None, rejected)``."""
    case = tuning.make_case(key, device)
    configs = tuning.configs(key)
    times: dict[str, float] = {}
    methods: dict[str, str] = {}
    launches: dict[str, int] = {}
    rejected: dict[str, str] = {}
    for config in runs.progress(configs, f"{tuning.name} {key_text(key)}"):
        name = str(config)
        try:
            case.check(config)
            torch.cuda.synchronize()
        except Exception as exc:
            prefix = "check: " if isinstance(exc, AssertionError) else ""
            rejected[name] = prefix + runs.first_line(exc)
            if not runs.cuda_alive():
                raise _lost(tuning, name, rejected[name])
            continue
        try:
            measured = timing.time_launches(functools.partial(case.run, config),
                                             warmup=args.warmup, rep=args.rep)
        except Exception as exc:
            rejected[name] = "timing: " + runs.first_line(exc)
            if not runs.cuda_alive():
                raise _lost(tuning, name, rejected[name])
            continue
        times[name] = round(measured["us"], 3)
        methods[name] = measured["method"]
        launches[name] = measured["launches"]
    del case
    torch.cuda.empty_cache()
    if not times:
        return None, rejected
    by_name = {str(c): c for c in configs}
    best = min(times, key=lambda n: (times[n], n))
    entry = {"key": key, "config": by_name[best].to_dict(), "times_us": times,
             "timing": {"method": methods[best], "warmup": args.warmup, "replays": args.rep,
                        "launches_per_replay": launches[best]},
             "versions": run_versions}
    if rejected:
        entry["rejected"] = rejected
    return entry, rejected


def cmd_tune(args) -> int:
    if runs.refuse_without_gpu("tune"):
        return runs.EXIT_NO_GPU
    started, tunings, device, dev = runs.start_gpu_run(args)
    out_dir, why = (Path(args.out), "--out") if args.out else default_out_dir()
    run_versions = runs.versions()
    print(f"dynctx autotune tune: {len(tunings)} kernels on {dev} -> {out_dir / dev} ({why})",
          flush=True)
    skipped: list[str] = []
    failures: list[str] = []
    written, lost = 0, False

    def out_of_time() -> bool:
        return args.max_seconds is not None and time.monotonic() - started > args.max_seconds

    for tuning in tunings:
        if lost:
            skipped.append(f"{tuning.name} (all keys: the CUDA context was lost)")
            continue
        if out_of_time():
            skipped.append(f"{tuning.name} (all keys: --max-seconds {args.max_seconds:g} spent)")
            continue
        keys = tuning.presets() if tuning.presets else []
        if not keys or tuning.make_case is None:
            skipped.append(f"{tuning.name} (no presets or no make_case)")
            continue
        path = out_dir / dev / f"{tuning.name}.json"
        done = {json.dumps(e["key"], sort_keys=True) for e in read_existing(path)}
        for key in keys:
            if args.skip_existing and json.dumps(key, sort_keys=True) in done:
                print(f"  {tuning.name} {key_text(key)}: already in {path.name}, kept", flush=True)
                continue
            if lost:
                skipped.append(f"{tuning.name} {key_text(key)} (the CUDA context was lost)")
                continue
            if out_of_time():
                skipped.append(f"{tuning.name} {key_text(key)} (--max-seconds spent)")
                continue
            key_started = time.monotonic()
            try:
                entry, rejected = tune_key(tuning, key, device, args, run_versions)
            except runs.CudaContextLost as exc:
                failures.append(str(exc))
                runs.note(f"dynctx autotune tune: {exc}; starting nothing more")
                lost = True
                continue
            except Exception as exc:  # make_case or configs failed: this key only
                failures.append(f"{tuning.name} {key_text(key)}: {runs.first_line(exc)}")
                print(f"  {tuning.name} {key_text(key)}: FAILED, {runs.first_line(exc)}",
                      flush=True)
                lost = not runs.cuda_alive()
                continue
            for name, reason in rejected.items():
                print(f"    rejected {name}: {reason}", flush=True)
            if entry is None:
                failures.append(f"{tuning.name} {key_text(key)}: no config passed its check")
                print(f"  {tuning.name} {key_text(key)}: FAILED, no config passed", flush=True)
                continue
            merge_write(path, dev, tuning.name, [entry], run_versions)
            written += 1
            best = min(entry["times_us"].values())
            print(f"  {tuning.name} {key_text(key)}: {KernelConfig.from_dict(entry['config'])} "
                  f"{best:.2f} us ({len(entry['times_us'])} timed, {len(rejected)} rejected, "
                  f"{time.monotonic() - key_started:.1f} s)", flush=True)
    print(f"dynctx autotune tune: wrote {written} entries under {out_dir / dev}", flush=True)
    for item in skipped:
        print(f"  skipped: {item}", flush=True)
    for item in failures:
        print(f"  failed: {item}", flush=True)
    return 1 if failures else 0
