"""Run ``case.check(config)`` for every registered kernel and every config of its search space at
its smallest preset key, on CUDA: a short, complete pass for ``compute-sanitizer``.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python3 bench/check_all_configs.py --max-seconds 60

(Without the caching allocator every tensor is its own allocation, so memcheck sees an
out-of-bounds access that would otherwise land inside a pooled block.) Prints one line per
kernel and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="start no new kernel after this many seconds")
    parser.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    args = parser.parse_args(argv)

    import torch

    from dynctx.kernels import registry

    if not torch.cuda.is_available():
        print("check_all_configs: needs a CUDA device", file=sys.stderr)
        return 2
    registry.import_kernel_modules()
    device = torch.device("cuda")
    started, failures = time.monotonic(), 0
    for tuning in registry.select_tunings(args.kernel, "all"):
        if time.monotonic() - started > args.max_seconds:
            print(f"{tuning.name}: skipped (--max-seconds {args.max_seconds:g} spent)", flush=True)
            continue
        keys = tuning.presets() if tuning.presets else []
        if not keys or tuning.make_case is None:
            print(f"{tuning.name}: skipped (no presets or no make_case)", flush=True)
            continue
        key = min(keys, key=lambda k: k[tuning.token_field])
        case = tuning.make_case(key, device)
        bad = []
        configs = tuning.configs(key)
        for config in configs:
            try:
                case.check(config)
                torch.cuda.synchronize()
            except Exception as exc:  # report every config, then go on
                bad.append(f"{config}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        failures += len(bad)
        print(f"{tuning.name} {registry.key_text(key)}: {len(configs) - len(bad)}/{len(configs)} "
              "configs pass", flush=True)
        for line in bad:
            print(f"    FAILED {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
