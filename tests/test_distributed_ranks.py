"""``distributed_ranks.run_spawned``: the spawned ranks run with ``python -P`` and one thread,
return their results, and a failing or hung rank fails the test with its traceback instead of
hanging it."""

from __future__ import annotations

import os
import sys
import time

import pytest
from distributed_ranks import run_spawned


def report_flags() -> dict:
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    return dict(safe_path=sys.flags.safe_path, omp=os.environ.get("OMP_NUM_THREADS"),
                threads=torch.get_num_threads(), world=dist.get_world_size(), total=int(total))


def fail_on_rank0_while_rank1_waits() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("rank zero's own error")
    time.sleep(120)       # busy elsewhere: stopped by run_spawned, not by the timeout


def sleep_too_long() -> None:
    time.sleep(120)


def test_ranks_run_with_safe_path_one_thread_and_return_results():
    results = run_spawned(report_flags, world_size=2, timeout_s=120)
    for rank in (0, 1):
        assert results[rank] == dict(safe_path=True, omp="1", threads=1, world=2, total=3)


def test_a_failing_rank_fails_with_its_traceback_and_stops_the_others():
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        run_spawned(fail_on_rank0_while_rank1_waits, world_size=2, timeout_s=120)
    text = str(error.value)
    assert "ranks [0] failed" in text and "ValueError: rank zero's own error" in text
    assert "fail_on_rank0_while_rank1_waits" in text          # the child's traceback
    assert "ranks ['rank1'] stopped after the failure" in text
    assert time.monotonic() - started < 100                   # not left to the timeout


def test_a_hung_rank_times_out():
    with pytest.raises(TimeoutError, match=r"ranks \['rank0', 'rank1'\] still running after "
                                           r"timeout_s=5"):
        run_spawned(sleep_too_long, world_size=2, timeout_s=5)
