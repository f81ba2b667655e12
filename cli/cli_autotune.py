"""``python -m dynctx autotune tune|show|check|bench``: tune, inspect, check and benchmark kernels.

- ``tune`` (CUDA only): for every registered kernel and each key of its ``presets()``, checks
  every config of the search space against the torch reference, times the ones that pass under
  CUDA graphs, and writes the fastest to ``<out>/<device>/<kernel>.json`` (merged with the
  entries of other keys already there).
- ``show``: the committed (and override) configs as a table.
- ``check``: validates the committed files (format, canonical text, configs inside the current
  search space, key fields); exit code 1 on any problem.
- ``bench`` (CUDA only): times the resolved config of every preset key against the torch
  reference and a device-to-device copy of the same bytes; writes ``bench/results/<device>.json``.

The kernels are found by importing ``dynctx.kernels.<module>`` for every name of
``KERNEL_MODULES`` (``dynctx.kernels._registry``, shared with ``bench/``): each module registers
its ``KernelTuning`` with ``_autotune.register``. The timing helper lives in
``dynctx.kernels._timing``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from dynctx._cli_common import HelpFormatter, plain, program_name, run_to_closed_stdout
from dynctx.kernels import _autotune
from dynctx.kernels._autotune import KernelConfig, KernelTuning
from dynctx.kernels._backend import HAS_TRITON, triton_interpreting
# KERNEL_MODULES and module_of are re-exported: callers of this module used to find them here.
from dynctx.kernels._registry import (KERNEL_MODULES, PRESET_MODULES,  # noqa: F401
                                      import_kernel_modules, key_text, module_of, select_tunings)
from dynctx.kernels._timing import time_launches

REPO_ROOT = _autotune.PACKAGED_DIR.parent
EXIT_NO_GPU = 2


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def git_revision() -> str:
    """``$DYNCTX_GIT_REVISION``, else ``git rev-parse HEAD`` (``+dirty`` when the working tree
    differs from it, untracked files included), else ``"unknown"`` (the device machine gets no
    ``.git``)."""
    if os.environ.get("DYNCTX_GIT_REVISION"):
        return os.environ["DYNCTX_GIT_REVISION"]
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain"],
                               check=True, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    import dynctx

    triton_version = "none"
    if HAS_TRITON:
        import triton

        triton_version = triton.__version__
    return {"dynctx": dynctx.__version__, "git_revision": git_revision(),
            "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton_version, "cuda": torch.version.cuda or "none"}


def _refuse_without_gpu(command: str) -> bool:
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    elif triton_interpreting():
        reason = "TRITON_INTERPRET is set: interpreter timings measure nothing"
    elif not HAS_TRITON:
        reason = "triton is not installed"
    if reason:
        _note(f"dynctx autotune {command}: refused: {reason}. `{command}` times compiled Triton "
              "kernels and needs a CUDA GPU; `show` and `check` run anywhere.")
        return True
    return False


class CudaContextLost(RuntimeError):
    """A launch faulted (an illegal address, say): nothing more can run in this process."""


def _gpu_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:limit]


def _cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # a fault (illegal address) poisons the CUDA context for good
        return False


def _read_existing(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return copy.deepcopy(_autotune.load_cache_file(path)["entries"])


def _merge_write(path: Path, device: str, kernel: str, new_entries: list[dict],
                 run_versions: dict) -> None:
    entries = {json.dumps(e["key"], sort_keys=True): e for e in _read_existing(path)}
    for entry in new_entries:
        entries[json.dumps(entry["key"], sort_keys=True)] = entry
    _autotune.write_cache_file(path, device=device, kernel=kernel, entries=list(entries.values()),
                               versions=run_versions)


def tune_key(tuning: KernelTuning, key: dict, device: torch.device, args,
             run_versions: dict) -> tuple[dict | None, dict[str, str]]:
    """Check and time every config for one key; return ``(entry or None, rejected)``."""
    case = tuning.make_case(key, device)
    configs = tuning.configs(key)
    times: dict[str, float] = {}
    methods: dict[str, str] = {}
    launches: dict[str, int] = {}
    rejected: dict[str, str] = {}
    progress = _progress(configs, f"{tuning.name} {key_text(key)}")
    for config in progress:
        name = str(config)
        try:
            case.check(config)
            torch.cuda.synchronize()
        except Exception as exc:
            prefix = "check: " if isinstance(exc, AssertionError) else ""
            rejected[name] = prefix + _first_line(exc)
            if not _cuda_alive():
                raise CudaContextLost(f"{tuning.name} {name} broke the CUDA context: "
                                      f"{rejected[name]}")
            continue
        try:
            timing = time_launches(lambda: case.run(config), warmup=args.warmup, rep=args.rep)
        except Exception as exc:
            rejected[name] = "timing: " + _first_line(exc)
            if not _cuda_alive():
                raise CudaContextLost(f"{tuning.name} {name} broke the CUDA context: "
                                      f"{rejected[name]}")
            continue
        times[name] = round(timing["us"], 3)
        methods[name] = timing["method"]
        launches[name] = timing["launches"]
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


def _progress(items: list, description: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    # disable=None: a bar on a terminal, nothing in a log file (the per-key line says it all).
    return tqdm(items, desc=description, unit="config", leave=False, disable=None,
                file=sys.stderr, dynamic_ncols=True)


def _start_gpu_run(args):
    """``(started, tunings, device, dev)`` of a tune or bench run: its start time, the selected
    kernel tunings, the GPU and that GPU's config-folder name."""
    started = time.monotonic()
    import_kernel_modules()
    tunings = select_tunings(args.kernel, args.preset)
    device = _gpu_device()
    return started, tunings, device, _autotune.device_name(device)


def cmd_tune(args) -> int:
    if _refuse_without_gpu("tune"):
        return EXIT_NO_GPU
    started, tunings, device, dev = _start_gpu_run(args)
    out_dir = Path(args.out) if args.out else _autotune.PACKAGED_DIR
    run_versions = versions()
    print(f"dynctx autotune tune: {len(tunings)} kernels on {dev} -> {out_dir / dev}", flush=True)
    skipped: list[str] = []
    failures: list[str] = []
    written, lost = 0, False
    for tuning in tunings:
        if lost:
            skipped.append(f"{tuning.name} (all keys: the CUDA context was lost)")
            continue
        if args.max_seconds is not None and time.monotonic() - started > args.max_seconds:
            skipped.append(f"{tuning.name} (all keys: --max-seconds {args.max_seconds:g} spent)")
            continue
        keys = tuning.presets() if tuning.presets else []
        if not keys or tuning.make_case is None:
            skipped.append(f"{tuning.name} (no presets or no make_case)")
            continue
        path = out_dir / dev / f"{tuning.name}.json"
        done = {json.dumps(e["key"], sort_keys=True) for e in _read_existing(path)}
        for key in keys:
            if args.skip_existing and json.dumps(key, sort_keys=True) in done:
                print(f"  {tuning.name} {key_text(key)}: already in {path.name}, kept", flush=True)
                continue
            if lost:
                skipped.append(f"{tuning.name} {key_text(key)} (the CUDA context was lost)")
                continue
            if args.max_seconds is not None and time.monotonic() - started > args.max_seconds:
                skipped.append(f"{tuning.name} {key_text(key)} (--max-seconds spent)")
                continue
            key_started = time.monotonic()
            try:
                entry, rejected = tune_key(tuning, key, device, args, run_versions)
            except CudaContextLost as exc:
                failures.append(str(exc))
                _note(f"dynctx autotune tune: {exc}; starting nothing more")
                lost = True
                continue
            except Exception as exc:  # make_case or configs failed: this key only
                failures.append(f"{tuning.name} {key_text(key)}: {_first_line(exc)}")
                print(f"  {tuning.name} {key_text(key)}: FAILED, {_first_line(exc)}", flush=True)
                lost = not _cuda_alive()
                continue
            for name, why in rejected.items():
                print(f"    rejected {name}: {why}", flush=True)
            if entry is None:
                failures.append(f"{tuning.name} {key_text(key)}: no config passed its check")
                print(f"  {tuning.name} {key_text(key)}: FAILED, no config passed", flush=True)
                continue
            _merge_write(path, dev, tuning.name, [entry], run_versions)
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


def _cache_roots(extra: list[str] | None = None) -> list[tuple[str, Path]]:
    roots = [("packaged", _autotune.PACKAGED_DIR)]
    override = os.environ.get(_autotune.OVERRIDE_ENV)
    if override:
        roots.insert(0, ("override", Path(override)))
    for folder in extra or []:
        roots.append(("dir", Path(folder)))
    return roots


def _cache_files(roots: list[tuple[str, Path]], device: str | None = None):
    for origin, root in roots:
        for path in sorted(root.glob("*/*.json")):
            if device is None or path.parent.name == device:
                yield origin, path


def cmd_show(args) -> int:
    """One block per config file: the key fields every entry shares on one line, then a table
    of the fields that vary (numbers sorted as numbers), the config and its time."""
    import_kernel_modules(quiet=True)
    roots = _cache_roots(args.dir)
    shown = 0
    for origin, path in _cache_files(roots, args.device):
        if shown:
            print()
        shown += 1
        try:
            data = _autotune.load_cache_file(path)
        except ValueError as exc:
            print(f"{path.parent.name}  {path.stem}  ({origin})  INVALID: {exc}")
            continue
        _print_file_block(data, origin)
    if not shown:
        where = ", ".join(str(root) for _, root in roots)
        device = f" for device {args.device}" if args.device else ""
        print(f"no committed configs{device} under {where}")
    return 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sort_value(value) -> tuple:
    """Numbers before text, numbers by value (so 16 sorts before 128)."""
    if _is_number(value):
        return (0, value, "")
    return (1, 0, str(value))


def _print_file_block(data: dict, origin: str) -> None:
    entries = data["entries"]
    print(f"{data['device']}  {data['kernel']}  ({origin}, {len(entries)} keys)")
    if not entries:
        return
    fields = sorted({name for entry in entries for name in entry["key"]})
    missing = object()
    shared = [name for name in fields
              if len({repr(entry["key"].get(name, missing)) for entry in entries}) == 1
              and name in entries[0]["key"]]
    varying = [name for name in fields if name not in shared]
    # The token count is the bucketed dimension: vary it fastest.
    varying.sort(key=lambda name: (name == "num_tokens", name))
    if shared:
        print("  all keys: " + " ".join(f"{name}={entries[0]['key'][name]}" for name in shared))
    rows = []
    for entry in sorted(entries, key=lambda e: tuple(_sort_value(e["key"].get(name, ""))
                                                       for name in varying)):
        config = str(KernelConfig.from_dict(entry["config"]))
        best = entry["times_us"].get(config, min(entry["times_us"].values()))
        rows.append((*(entry["key"].get(name, "-") for name in varying), config, f"{best:.2f}"))
    numeric = [all(_is_number(entry["key"].get(name)) for entry in entries)
               for name in varying] + [False, True]
    _print_table((*varying, "config", "us"), rows, numeric=numeric, indent="  ")


def _print_table(header: tuple[str, ...], rows: list[tuple], *, numeric: list[bool] | None = None,
                 indent: str = "") -> None:
    """Columns two spaces apart; numeric columns right-aligned."""
    rows = [tuple(str(c) for c in row) for row in rows]
    numeric = numeric or [False] * len(header)
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells) -> str:
        return indent + "  ".join(c.rjust(w) if right else c.ljust(w)
                                  for c, w, right in zip(cells, widths, numeric)).rstrip()

    print(line(header))
    for row in rows:
        print(line(row))


def check_file(path: Path) -> list[str]:
    """Every problem of one config file; empty when it is valid, canonical and in range."""
    problems = []
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        return [f"{path}: not valid JSON ({exc})"]
    try:
        _autotune.validate_cache_data(data, str(path))
    except ValueError as exc:
        return [str(exc)]
    if data["kernel"] != path.stem:
        problems.append(f"{path}: kernel {data['kernel']!r} does not match the file name")
    if data["device"] != path.parent.name:
        problems.append(f"{path}: device {data['device']!r} does not match the folder name")
    ordered = sorted(data["entries"], key=lambda e: json.dumps(e["key"], sort_keys=True))
    if text != _autotune.canonical_json({**data, "entries": ordered}):
        problems.append(f"{path}: not canonical (rewrite it with _autotune.write_cache_file: "
                        "sorted keys and entries, 2-space indent, final newline)")
    tuning = _autotune.registered().get(data["kernel"])
    if tuning is None:
        problems.append(f"{path}: no registered kernel named {data['kernel']!r}")
        return problems
    fields = _key_fields(tuning)
    for i, entry in enumerate(data["entries"]):
        key = entry["key"]
        where = f"{path}: entry {i} ({key_text(key)})"
        if fields is not None and set(key) != fields:
            problems.append(f"{where}: key fields {sorted(key)} != "
                            f"{tuning.name}'s {sorted(fields)}")
            continue
        tokens = key.get(tuning.token_field)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or \
                _autotune.bucket_tokens(max(tokens, 0)) != tokens:
            problems.append(f"{where}: {tuning.token_field}={tokens!r} is not a power-of-two "
                            "bucket")
        config = KernelConfig.from_dict(entry["config"])
        try:
            space = tuning.configs(key)
        except Exception as exc:
            problems.append(f"{where}: {tuning.name}_configs(key) raised {_first_line(exc)}")
            continue
        if config not in space:
            problems.append(f"{where}: config {config} is outside the current search space")
        if str(config) not in entry["times_us"]:
            problems.append(f"{where}: the chosen config {config} has no measured time")
    return problems


def _key_fields(tuning: KernelTuning) -> set[str] | None:
    """The key fields of a kernel, read off its presets (None when it declares none)."""
    keys = tuning.presets() if tuning.presets else []
    return set(keys[0]) if keys else None


def cmd_check(args) -> int:
    status = import_kernel_modules(quiet=True)
    roots = [("dir", Path(folder)) for folder in args.dir] if args.dir else _cache_roots()
    files = [path for _, path in _cache_files(roots)]
    problems = [p for path in files for p in check_file(path)]
    for module, why in status.items():
        if why != "ok" and not why.endswith("does not exist yet"):
            problems.append(f"dynctx.kernels.{module}: {why}")
    for problem in problems:
        print(f"PROBLEM {problem}")
    where = ", ".join(str(root) for _, root in roots)
    print(f"dynctx autotune check: {len(files)} files under {where}, {len(problems)} problems")
    return 1 if problems else 0


def _load_bench_helper(name: str):
    """``bench/<name>.py`` of the checkout, when this install has one (editable installs)."""
    path = REPO_ROOT / "bench" / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"_dynctx_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peers(tuning: KernelTuning, case, config: KernelConfig) -> dict[str, dict]:
    """Peer implementations of the same work on the same buffers, where one is available:
    ``{name: {"run": callable, "check": callable or None}}``."""
    peers = {}
    if tuning.name == "kv_append":
        helper = _load_bench_helper("megatron_kv_append")
        if helper is not None:
            runner, why = helper.runner_from_case(case)
            if runner is not None:
                peers["megatron_core"] = {
                    "run": runner, "check": lambda: helper.check_against_ours(case, config)}
            else:
                _note(f"  megatron-core kv_append not compared: {why}")
    return peers


def bench_key(tuning: KernelTuning, key: dict, device: torch.device, args) -> dict:
    config, source = _autotune.resolve_config(tuning.name, key, device)
    result = {"kernel": tuning.name, "key": key, "config": str(config),
              "config_source": source.split(":", 1)[0]}
    case = tuning.make_case(key, device)
    result["bytes_moved"] = int(case.bytes_moved)
    try:
        case.check(config)
        torch.cuda.synchronize()
        result["check"] = "passed"
    except Exception as exc:
        result["check"] = _first_line(exc)
        if not _cuda_alive():
            raise CudaContextLost(f"{tuning.name} {config} broke the CUDA context: "
                                  f"{result['check']}")
        return result
    kernel = time_launches(lambda: case.run(config), warmup=args.warmup, rep=args.rep)
    result["kernel_us"] = round(kernel["us"], 3)
    result["timing"] = kernel["method"]
    try:
        reference = time_launches(case.run_reference, warmup=args.warmup, rep=args.rep,
                                  graph=False)
        result["reference_us"] = round(reference["us"], 3)
        result["reference_timing"] = reference["method"]
    except Exception as exc:
        result["reference_error"] = _first_line(exc)
        if not _cuda_alive():
            raise CudaContextLost(f"{tuning.name} reference broke the CUDA context")
    half = max(1, case.bytes_moved // 2)
    source_buffer = torch.randint(0, 255, (half,), dtype=torch.uint8, device=device)
    target_buffer = torch.empty_like(source_buffer)
    copy_time = time_launches(lambda: target_buffer.copy_(source_buffer), warmup=args.warmup,
                              rep=args.rep)
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
    for peer_name, peer in _peers(tuning, case, config).items():
        record = result.setdefault("peers", {}).setdefault(peer_name, {})
        try:
            if peer["check"] is not None:
                peer["check"]()
                record["check"] = "passed"
            timing = time_launches(peer["run"], warmup=args.warmup, rep=args.rep)
            record.update(us=round(timing["us"], 3), speedup=round(timing["us"] / kernel["us"], 3))
        except Exception as exc:
            record["error"] = _first_line(exc)
            if not _cuda_alive():
                raise CudaContextLost(f"peer {peer_name} broke the CUDA context")
    del case
    torch.cuda.empty_cache()
    return result


def cmd_bench(args) -> int:
    if _refuse_without_gpu("bench"):
        return EXIT_NO_GPU
    started, tunings, device, dev = _start_gpu_run(args)
    bench_dir = REPO_ROOT / "bench" if (REPO_ROOT / "bench").is_dir() else Path.cwd() / "bench"
    out = Path(args.out) if args.out else bench_dir / "results" / f"{dev}.json"
    results, skipped, fatal = [], [], None
    run_versions = versions()

    def write_results() -> None:  # after every key, so a run cut short keeps what it measured
        data = {"device": dev, "versions": run_versions, "results": results}
        if skipped:
            data["skipped"] = skipped
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_autotune.canonical_json(data))

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
            except CudaContextLost as exc:
                fatal = str(exc)
                _note(f"dynctx autotune bench: {exc}")
                continue
            except Exception as exc:  # make_case or a timing failed: this key only
                results.append({"kernel": tuning.name, "key": key, "config": "-",
                                "config_source": "-", "check": f"error: {_first_line(exc)}"})
                if not _cuda_alive():
                    fatal = f"{tuning.name} {key_text(key)} broke the CUDA context"
            write_results()
            row = results[-1]
            print(f"  {row['kernel']} {key_text(key)}: {row.get('kernel_us', '-')} us "
                  f"({row['config_source']} {row['config']}; check {row['check']})", flush=True)
    write_results()
    _print_bench_table(results)
    for item in skipped:
        print(f"  skipped: {item}")
    print(f"dynctx autotune bench: {len(results)} results -> {out}")
    failed = [r for r in results if r.get("check") != "passed"]
    return 1 if (failed or fatal) else 0


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_bench_table(results: list[dict]) -> None:
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
    _print_table(("kernel", "key", "config", "us", "GB/s", "copy GB/s", "vs copy", "vs torch",
                  "vs mcore", "check"), rows)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def build_parser(prog: str = "python -m dynctx autotune") -> argparse.ArgumentParser:
    summary, commands = __doc__.split("\n\n")[:2]
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description=plain(summary).replace("python -m dynctx autotune", prog),
        epilog=plain(commands))
    commands = parser.add_subparsers(dest="command", required=True)

    def add_selection(sub):
        sub.add_argument("--kernel", action="append", metavar="NAME",
                         help="a registered kernel name (repeatable); default: every kernel")
        sub.add_argument("--preset", choices=("all", *PRESET_MODULES), default="all",
                         help="kernel group: llama (the attention path every model shares), "
                              "mla, mamba, or all (default)")
        sub.add_argument("--max-seconds", type=_positive_float, default=None,
                         help="start no new kernel or key after this many seconds; the rest is "
                              "listed as skipped")
        sub.add_argument("--warmup", type=int, default=10, help="eager calls before timing")
        sub.add_argument("--rep", type=int, default=20, help="timed CUDA-graph replays")

    tune = commands.add_parser("tune", formatter_class=HelpFormatter,
                               help="tune every kernel's preset keys on this CUDA GPU")
    add_selection(tune)
    tune.add_argument("--out", metavar="DIR", default=None,
                      help=f"root folder of the configs (default {_autotune.PACKAGED_DIR})")
    tune.add_argument("--skip-existing", action="store_true",
                      help="keep keys already present in the output files instead of re-tuning")
    tune.set_defaults(run=cmd_tune)

    show = commands.add_parser("show", formatter_class=HelpFormatter,
                               help="table of the committed configs")
    show.add_argument("--device", default=None,
                      help="only this device folder, e.g. NVIDIA_H200 (default: every device)")
    show.add_argument("--dir", action="append", metavar="DIR",
                      help="also show the configs under this root folder (repeatable)")
    show.set_defaults(run=cmd_show)

    check = commands.add_parser("check", formatter_class=HelpFormatter,
                                help="validate the committed config files")
    check.add_argument("--dir", action="append", metavar="DIR",
                       help="check the files under this root folder (repeatable) instead of "
                            "the packaged folder and $DYNCTX_AUTOTUNE_DIR")
    check.set_defaults(run=cmd_check)

    bench = commands.add_parser("bench", formatter_class=HelpFormatter,
                                help="time resolved configs against torch and a copy")
    add_selection(bench)
    bench.add_argument("--out", metavar="FILE", default=None,
                       help="results file (default bench/results/<device>.json)")
    bench.set_defaults(run=cmd_bench)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog or f"{program_name()} autotune").parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(run_to_closed_stdout(main))
