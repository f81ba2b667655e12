"""``autotune bench``: time the resolved config of every preset key against the torch
reference, a device-to-device copy of the same bytes and, for ``kv_append``, Megatron-Core's own
kernel (``dynctx.megatron_peer``); print a table, and write the results where ``--out`` points
(nothing is written without it)."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from dynctx import autotune_runs as runs
from dynctx import megatron_peer
from dynctx.autotune_files import cache_roots, print_table
from dynctx.kernels import autotune, timing
from dynctx.kernels.autotune import KernelConfig, KernelTuning
from dynctx.kernels.registry import key_text


def peers(tuning: KernelTuning, case, config: KernelConfig) -> dict[str, dict]:
    """Peer implementations of the same work on the same buffers, where one is available:
    ``{name: {"run": callable, "check": callable or None}}``."""
    found = {}
    if tuning.name == "kv_append":
        runner, why = megatron_peer.runner_from_case(case)
        if runner is not None:
            found["megatron_core"] = {
                "run": runner, "check": lambda: megatron_peer.check_against_ours(case, config)}
        else:
            runs.note(f"  megatron-core kv_append not compared: {why}")
    return found


def _time(fn, args, **kwargs) -> dict:
    return timing.time_launches(fn, warmup=args.warmup, rep=args.rep, **kwargs)


def bench_key(tuning: KernelTuning, key: dict, device: torch.device, args) -> dict:
    config, source = autotune.resolve_config(tuning.name, key, device)
    result = {"kernel": tuning.name, "key": key, "config": str(config),
              "config_source": source.split(":", 1)[0]}
    case = tuning.make_case(key, device)
    result["bytes_moved"] = int(case.bytes_moved)
    try:
        case.check(config)
        torch.cuda.synchronize()
        result["check"] = "passed"
    except Exception as exc:
        result["check"] = runs.first_line(exc)
        if not runs.cuda_alive():
            raise runs.CudaContextLost(f"{tuning.name} {config} broke the CUDA context: "
                                       f"{result['check']}")
        return result
    kernel = _time(functools.partial(case.run, config), args)
    result["kernel_us"] = round(kernel["us"], 3)
    result["timing"] = kernel["method"]
    try:
        reference = _time(case.run_reference, args, graph=False)
        result["reference_us"] = round(reference["us"], 3)
        result["reference_timing"] = reference["method"]
    except Exception as exc:
        result["reference_error"] = runs.first_line(exc)
        if not runs.cuda_alive():
            raise runs.CudaContextLost(f"{tuning.name} reference broke the CUDA context")
    half = max(1, case.bytes_moved // 2)
    source_buffer = torch.randint(0, 255, (half,), dtype=torch.uint8, device=device)
    target_buffer = torch.empty_like(source_buffer)
    copy_time = _time(functools.partial(target_buffer.copy_, source_buffer), args)
    result["copy_us"] = round(copy_time["us"], 3)
    del source_buffer, target_buffer
    l2_bytes = (getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
                if device.type == "cuda" else 0)
    result["fits_in_l2"] = bool(l2_bytes and case.bytes_moved <= l2_bytes)
    if case.bytes_moved:
        result["kernel_gbps"] = round(case.bytes_moved / kernel["us"] / 1e3, 2)
        result["copy_gbps"] = round(case.bytes_moved / copy_time["us"] / 1e3, 2)
        result["ratio_to_copy"] = round(copy_time["us"] / kernel["us"], 4)
    if "reference_us" in result:
        result["speedup_vs_reference"] = round(result["reference_us"] / kernel["us"], 3)
    for peer_name, peer in peers(tuning, case, config).items():
        record = result.setdefault("peers", {}).setdefault(peer_name, {})
        try:
            if peer["check"] is not None:
                peer["check"]()
                record["check"] = "passed"
            measured = _time(peer["run"], args)
            record.update(us=round(measured["us"], 3),
                          speedup=round(measured["us"] / kernel["us"], 3))
        except Exception as exc:
            record["error"] = runs.first_line(exc)
            if not runs.cuda_alive():
                raise runs.CudaContextLost(f"peer {peer_name} broke the CUDA context")
    del case
    torch.cuda.empty_cache()
    return result


def cmd_bench(args) -> int:
    if runs.refuse_without_gpu("bench"):
        return runs.EXIT_NO_GPU
    cache_roots()  # a wrong $DYNCTX_AUTOTUNE_DIR is an error before anything runs
    started, tunings, device, dev = runs.start_gpu_run(args)
    out = Path(args.out) if args.out else None
    results, skipped, fatal = [], [], None
    run_versions = runs.versions()

    def write_results() -> None:  # after every key, so a run cut short keeps what it measured
        if out is None:
            return
        data = {"device": dev, "versions": run_versions, "results": results}
        if skipped:
            data["skipped"] = skipped
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(autotune.canonical_json(data))

    for tuning in tunings:
        keys = tuning.presets() if tuning.presets and tuning.make_case else []
        for key in keys:
            if args.max_seconds is not None and time.monotonic() - started > args.max_seconds:
                skipped.append(f"{tuning.name} {key_text(key)}")
                continue
            if fatal:
                skipped.append(f"{tuning.name} {key_text(key)} (CUDA context lost)")
                continue
            try:
                results.append(bench_key(tuning, key, device, args))
            except runs.CudaContextLost as exc:
                fatal = str(exc)
                runs.note(f"dynctx autotune bench: {exc}")
                continue
            except Exception as exc:  # make_case or a timing failed: this key only
                results.append({"kernel": tuning.name, "key": key, "config": "-",
                                "config_source": "-", "check": f"error: {runs.first_line(exc)}"})
                if not runs.cuda_alive():
                    fatal = f"{tuning.name} {key_text(key)} broke the CUDA context"
            write_results()
            row = results[-1]
            print(f"  {row['kernel']} {key_text(key)}: {row.get('kernel_us', '-')} us "
                  f"({row['config_source']} {row['config']}; check {row['check']})", flush=True)
    write_results()
    print_bench_table(results)
    for item in skipped:
        print(f"  skipped: {item}")
    where = out if out is not None else "not written (no --out)"
    print(f"dynctx autotune bench: {len(results)} results -> {where}")
    failed = [r for r in results if r.get("check") != "passed"]
    return 1 if (failed or fatal) else 0


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_bench_table(results: list[dict]) -> None:
    if not results:
        return
    rows = []
    for r in results:
        peer = r.get("peers", {}).get("megatron_core", {}).get("speedup")
        rows.append((r["kernel"], key_text(r["key"]), r["config_source"],
                     _fmt(r.get("kernel_us"), ".2f"), _fmt(r.get("kernel_gbps"), ".0f"),
                     _fmt(r.get("copy_gbps"), ".0f"), _fmt(r.get("ratio_to_copy"), ".2f"),
                     _fmt(r.get("speedup_vs_reference"), ".2f"), _fmt(peer, ".2f"),
                     "ok" if r.get("check") == "passed" else "FAIL"))
    print_table(("kernel", "key", "config", "us", "GB/s", "copy GB/s", "vs copy", "vs torch",
                 "vs mcore", "check"), rows)
