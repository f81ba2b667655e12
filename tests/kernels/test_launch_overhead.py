"""bench/launch_overhead.py runs every launcher through the stub driver and gives each a row.

Timings are never asserted (they belong to the script's output); this checks that the script
measures what it says: one row per registered tuning, each launch and lookup timed.
"""

from __future__ import annotations

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
