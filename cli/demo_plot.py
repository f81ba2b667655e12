"""The demo's plot: active and paused requests, evictions and KV utilization per engine step
(``python -m dynctx demo --plot PATH``), in windows of steps for long runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass
class StepRecord:
    """What the plot shows of one engine step."""

    step: int
    active: int
    paused: int
    evictions: int
    kv_utilization: float


# Above this many steps the plot shows windows (mean line, min-max band) instead of every step.
PLOT_MAX_POINTS = 400


def aggregate(history: List[StepRecord], max_points: int = PLOT_MAX_POINTS) -> dict:
    """Per-window arrays for the plot: ``step`` (window start), mean/min/max of active and
    paused requests, mean KV utilization (%) and evictions per window. One window per step when
    ``history`` has at most ``max_points`` steps."""
    import numpy as np

    n = len(history)
    width = max(1, -(-n // max_points))
    steps = np.array([h.step for h in history], dtype=np.int64)
    columns = {name: np.array([getattr(h, name) for h in history], dtype=np.float64)
               for name in ("active", "paused", "evictions", "kv_utilization")}
    starts = np.arange(0, n, width)
    out = {"width": width, "step": steps[starts]}
    for name in ("active", "paused"):
        out[f"{name}_mean"] = np.add.reduceat(columns[name], starts) / np.diff(np.append(starts, n))
        out[f"{name}_min"] = np.minimum.reduceat(columns[name], starts)
        out[f"{name}_max"] = np.maximum.reduceat(columns[name], starts)
    out["kv_percent"] = 100 * np.add.reduceat(columns["kv_utilization"], starts) / \
        np.diff(np.append(starts, n))
    out["evictions"] = np.add.reduceat(columns["evictions"], starts)
    return out


def plot_history(history: List[StepRecord], path: str, title: str) -> None:
    """Active and paused requests and KV utilization per step; at more than
    ``PLOT_MAX_POINTS`` steps, per window of steps: the mean as a line, min to max as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = aggregate(history)
    width = data["width"]
    steps = data["step"]
    fig, axis = plt.subplots(figsize=(10, 4.8))
    for name, label, color in (("active", "active requests", "tab:blue"),
                               ("paused", "paused requests", "tab:orange")):
        if width == 1:
            axis.step(steps, data[f"{name}_mean"], where="post", label=label, color=color)
        else:
            axis.plot(steps, data[f"{name}_mean"], label=f"{label} (mean)", color=color)
            axis.fill_between(steps, data[f"{name}_min"], data[f"{name}_max"], step="post",
                              color=color, alpha=0.2, linewidth=0,
                              label=f"{label} (min-max)")
    evicted = data["evictions"] > 0
    if evicted.any():
        per = "" if width == 1 else f" (windows with any, of {width} steps)"
        axis.scatter(steps[evicted], [0] * int(evicted.sum()), marker="x", color="red",
                     zorder=3, label=f"evictions{per}")
    axis.set_xlabel("engine step")
    axis.set_ylabel("requests")
    axis.set_ylim(bottom=0)
    util = axis.twinx()
    util.plot(steps, data["kv_percent"], color="gray", alpha=0.7,
              label="KV blocks allocated (%)" + ("" if width == 1 else " (mean)"))
    util.set_ylabel("KV blocks allocated (%)")
    util.set_ylim(0, 105)
    lines = axis.get_legend_handles_labels()
    more = util.get_legend_handles_labels()
    # Below the plot, so that it never hides the curves.
    axis.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", fontsize=8,
                bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    if width > 1:
        title += f"\n{len(history)} steps shown in windows of {width}"
    axis.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
