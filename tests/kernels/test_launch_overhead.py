"""bench/launch_overhead.py runs every launcher through the stub driver and gives each a row.

Timings are never asserted (they belong to the script's output); this checks that the script
measures what it says: one row per registered tuning, each launch and lookup timed.
"""

from __future__ import annotations

import importlib

import pytest

from dynctx.kernels import autotune, launch_plan, registry
from dynctx.kernels.backend import HAS_TRITON, triton_interpreting

pytestmark = [
    pytest.mark.build,
    pytest.mark.skipif(not HAS_TRITON or triton_interpreting(),
                       reason="needs triton, compiled (TRITON_INTERPRET unset)"),
]


def test_every_launcher_gets_a_row(capsys):
    import launch_overhead

    registry.import_kernel_modules(quiet=True)
    result = launch_overhead.measure(calls=2, repeats=1)
    assert [row["kernel"] for row in result["rows"]] == [
        t.name for t in registry.select_tunings(None)]
    assert sorted(row["kernel"] for row in result["rows"]) == sorted(autotune.registered())
    assert result["floor_us"] > 0
    for row in result["rows"]:
        assert row["launch_us"] > 0 and row["dispatch_us"] > 0
        assert row["lookup_us"] > 0 and row["lookup_uncached_us"] > 0
        # The launch with the recent plans' guard off, where this torch has the guard.
        assert (row["lru_only_us"] > 0) == (launch_plan.GUARDS is not None)


def test_the_decode_loop_times_each_way_of_keying():
    """--decode-loop: paged attention's max_seqlen_k 254..256 is one bucket: one miss with the
    lengths' classes in the key, one per step with the lengths themselves, every call without
    plans; the count launchers' calls of a decode step, a mixed step and a decode step again
    are two classes, and every call without plans."""
    import launch_overhead

    result = launch_overhead.decode_loop(steps=3, layers=2, start=254, repeats=1)
    ways = result["ways"]
    assert list(ways) == ["classes", "exact", "no plan"]
    misses = {way: {name: row["misses_per_loop"] for name, row in rows.items()}
              for way, rows in ways.items()}
    assert misses["classes"] == {"paged_attention": 1, "step_metadata": 2,
                                 "compact_requests": 1, "last_token_logits": 1}
    assert misses["exact"]["paged_attention"] == 3
    assert misses["no plan"] == {"paged_attention": 6, "step_metadata": 3,
                                 "compact_requests": 3, "last_token_logits": 3}
    for rows in ways.values():
        for row in rows.values():
            assert 0 < row["step_us_median"] <= row["step_us_max"]
            assert row["call_us_mean"] > 0
    # Each launcher's own classes are back in place.
    from dynctx.kernels import launch_plan as plans
    from dynctx.kernels import paged_attention_plan, step_metadata_counts
    module = importlib.import_module
    assert (module("dynctx.kernels.paged_attention").length_classes
            is paged_attention_plan.length_classes)
    assert (module("dynctx.kernels.step_metadata").count_classes
            is step_metadata_counts.count_classes)
    assert module("dynctx.kernels.last_token_logits").count_class is plans.count_class
    assert module("dynctx.kernels.compaction")._row_classes.__module__ == (
        "dynctx.kernels.compaction")
