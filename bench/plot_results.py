"""Plot ``bench/results/<device>.json`` (``python -m dynctx autotune bench --out``) as a PNG.

Left: achieved GB/s of each kernel key beside a device-to-device copy of the same bytes.
Right: speedup over the torch reference (and over Megatron-Core's kv append where measured),
log scale, 1 marked. Only numbers present in the file are drawn.

    python bench/plot_results.py bench/results/NVIDIA_H200.json [--out FILE.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _label(row: dict) -> str:
    """``kv_append num_tokens=64 head_dim=128 num_heads=8``: the token field first, then the
    other key fields (dtype left out, true flags by name, false ones dropped)."""
    key = dict(row["key"])
    token_field = next((k for k in ("num_tokens", "num_requests", "num_rows") if k in key), None)
    first = [f"{token_field}={key.pop(token_field)}"] if token_field else []
    rest = [k if v is True else f"{k}={v}" for k, v in sorted(key.items())
            if k != "dtype" and v is not False]
    return " ".join([row["kernel"], *first, *rest])


def plot(results_path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results_path.read_text())
    rows = [r for r in data["results"] if "kernel_gbps" in r]
    if not rows:
        raise SystemExit(f"{results_path}: no timed results to plot")
    labels = [_label(r) for r in rows]
    positions = list(range(len(rows)))
    height = max(4.0, 0.28 * len(rows) + 1.5)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, height), sharey=True)

    bar = 0.4
    left.barh([p - bar / 2 for p in positions], [r["kernel_gbps"] for r in rows], bar,
              label="kernel")
    left.barh([p + bar / 2 for p in positions], [r["copy_gbps"] for r in rows], bar,
              label="copy of the same bytes", color="lightgray")
    left.set_yticks(positions, labels, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("GB/s (bytes read + written / median time)")
    left.legend(loc="lower right", fontsize=8)
    left.grid(axis="x", alpha=0.3)

    series = [("vs torch reference", [r.get("speedup_vs_reference") for r in rows])]
    megatron = [r.get("peers", {}).get("megatron_core", {}).get("speedup") for r in rows]
    if any(v is not None for v in megatron):
        series.append(("vs Megatron-Core kv append", megatron))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        points = [(p - 0.4 + width * (i + 0.5), v) for p, v in zip(positions, values) if v]
        if points:
            right.barh([p for p, _ in points], [v for _, v in points], width, label=name)
    right.set_xscale("log")
    right.axvline(1.0, color="black", linewidth=0.8)
    right.set_xlabel("speedup (x, log scale)")
    right.legend(loc="lower right", fontsize=8)
    right.grid(axis="x", alpha=0.3)

    versions = data.get("versions", {})
    fig.suptitle(f"dynctx kernels on {data.get('device', '?')} "
                 f"(torch {versions.get('torch', '?')}, triton {versions.get('triton', '?')}, "
                 f"rev {versions.get('git_revision', '?')[:12]})",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="bench/results/<device>.json")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG path (default: beside the results, <device>.png)")
    args = parser.parse_args(argv)
    out = args.out or args.results.with_suffix(".png")
    print(plot(args.results, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
