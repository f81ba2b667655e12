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
    """--decode-loop: max_seqlen_k 254..256 is one bucket: one miss with the lengths' classes
    in the key, one per step with the lengths themselves, every call without plans."""
    import launch_overhead

    result = launch_overhead.decode_loop(steps=3, layers=2, start=254, repeats=1)
    ways = result["ways"]
    assert [ways[way]["misses_per_loop"] for way in ("classes", "exact", "no plan")] == [1, 3, 6]
    for row in ways.values():
        assert 0 < row["step_us_median"] <= row["step_us_max"]
        assert row["call_us_mean"] > 0
    # The launcher's own length_classes is back in place.
    from dynctx.kernels import paged_attention_plan
    module = importlib.import_module("dynctx.kernels.paged_attention")
    assert module.length_classes is paged_attention_plan.length_classes
