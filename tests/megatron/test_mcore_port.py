"""The port's own machinery (mcore_port.py): the rank launcher fails when a rank fails, runs
every rank in one group, and times out; an implementation's test context restores what the
tests change."""

from __future__ import annotations

import os
import time

import pytest
import torch
from mcore_port import IMPLS, ROUNDER_ATTRS, load_impl, run_ranks  # noqa: E402


def _sum_ranks(out_dir):
    rank = torch.distributed.get_rank()
    total = torch.tensor([rank + 1])
    torch.distributed.all_reduce(total)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(str(int(total)))


def _fail_on_rank_1():
    if torch.distributed.get_rank() == 1:
        raise ValueError("rank 1 refuses")


def _sleep():
    time.sleep(60)


def test_run_ranks_runs_every_rank_in_one_gloo_group(tmp_path):
    run_ranks(_sum_ranks, world_size=2, args=(str(tmp_path),), timeout_s=60)
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["3", "3"]


def test_run_ranks_raises_with_the_failing_ranks_traceback():
    pattern = r"(?s)'rank1': 1.*rank 1 ---.*ValueError: rank 1 refuses"
    with pytest.raises(RuntimeError, match=pattern):
        run_ranks(_fail_on_rank_1, world_size=2, timeout_s=60)


def test_run_ranks_kills_ranks_past_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \['rank0', 'rank1'\] still running"):
        run_ranks(_sleep, world_size=2, timeout_s=1)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("name", IMPLS)
def test_running_restores_the_rounders_and_the_cpu_patch(name):
    impl = load_impl(name)
    cls = impl.context_class
    before = {attr: cls.__dict__.get(attr, "missing") for attr in ROUNDER_ATTRS}
    real_current_device = torch.cuda.current_device
    with impl.running():
        for attr in ROUNDER_ATTRS:
            setattr(impl.DynamicInferenceContext, attr, 7)
        assert cls.TOKEN_ROUNDER == 7 and cls.REQUEST_ROUNDER == 7
        if name == "megatron":
            assert torch.cuda.current_device() == "cpu"
    assert {attr: cls.__dict__.get(attr, "missing") for attr in ROUNDER_ATTRS} == before
    assert torch.cuda.current_device is real_current_device


def test_load_impl_refuses_unknown_names():
    with pytest.raises(ValueError, match="impl='vllm' must be one of"):
        load_impl("vllm")
