"""Launch plans keyed on what a launch depends on, not on the raw lengths and counts.

Paged attention's plan key holds the classes of ``max_seqlen_q`` and ``max_seqlen_k``
(kernels/paged_attention_plan.py): a decode loop, whose ``max_seqlen_k`` grows by one every
step, reuses one plan per bucket of the tuning key and one set of launches per split count.

* under TRITON_INTERPRET=1 (marker ``interpreter``): a decode loop misses once per bucket, and
  every step equals the torch reference; a length the checks refuse is still refused on a hit,
  with nothing written, and the good call right after is a hit;
* through the compile-only sm_90 driver (marker ``build``): decode loops (split counts changing
  inside a bucket, a window, buckets crossed) and mixed steps (query tiles changing) launch the
  same builds, grids and arguments with plans as without, most of them from varied launches;
  ``KernelLaunch.varied`` refuses what would change the compiled kernel.
"""

from __future__ import annotations

import pytest
import torch

from dynctx.kernels import launch_plan
from dynctx.kernels.autotune import KernelConfig
from dynctx.kernels.backend import HAS_TRITON, triton_interpreting
from dynctx.kernels.launch_plan import clear_plans, plan_caches

HEADS, KV_HEADS, DIM = 4, 2, 16


def _paged_case(kv_lengths, *, block_size=16, columns=9, seed=0):
    """A paged cache of ``columns`` blocks per request (capacity ``columns * block_size``
    keys), one query per request."""
    gen = torch.Generator().manual_seed(seed)
    requests = len(kv_lengths)
    num_blocks = requests * columns + 1
    shape = (num_blocks, block_size, KV_HEADS, DIM)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:requests * columns]
    return dict(query=torch.randn(requests, HEADS, DIM, generator=gen), key_cache=key_cache,
                value_cache=value_cache,
                cu_query_lengths=torch.arange(requests + 1, dtype=torch.int32),
                kv_seq_lengths=torch.tensor(kv_lengths, dtype=torch.int32),
                block_table=table.view(requests, columns).to(torch.int32))


def _attend(case, backend, **kwargs):
    from dynctx.kernels import paged_attention

    return paged_attention(**case, backend=backend, **kwargs)


@pytest.mark.interpreter
@pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1")
class TestUnderTheInterpreter:
    @pytest.mark.parametrize("config", [None, KernelConfig.make(BLOCK_N=16, SPLIT_TOKENS=16,
                                                                num_warps=4)],
                             ids=["tuned", "splits_of_16"])
    def test_a_decode_loop_plans_once_per_bucket(self, config):
        """``max_seqlen_k`` from 120 to 136 crosses the bucket 128 -> 256: two plans. With
        splits of 16 keys the loop walks 8 split counts, each launched from the plan of its
        bucket."""
        clear_plans()
        cache = plan_caches()["paged_attention"]
        case = _paged_case([120, 113])
        misses, counts = 0, set()
        for step, max_seqlen_k in enumerate(range(120, 137)):
            case["kv_seq_lengths"] = torch.tensor([max_seqlen_k, max_seqlen_k - 7],
                                                  dtype=torch.int32)
            args = dict(max_seqlen_q=1, max_seqlen_k=max_seqlen_k, config=config)
            before = cache.misses
            got = _attend(case, "triton", **args)
            misses += cache.misses - before
            want = _attend(case, "torch", max_seqlen_q=1, max_seqlen_k=max_seqlen_k)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5,
                                       msg=lambda m, step=step: f"step {step}: {m}")
            counts.add(-(-max_seqlen_k // (config or KernelConfig.make(SPLIT_TOKENS=128))
                         .kwargs["SPLIT_TOKENS"]))
        assert misses == 2
        plans = list(cache._plans.values())
        assert len(plans) == 2
        assert sorted(count for plan in plans for count, _ in plan.variants) == sorted(counts)

    def test_a_length_refused_by_the_checks_is_refused_on_a_hit(self):
        """The key no longer holds ``max_seqlen_k``: 145 is in the bucket of 144 (the block
        table's capacity), and is still refused with the output untouched."""
        clear_plans()
        cache = plan_caches()["paged_attention"]
        case = _paged_case([144, 100])
        out = torch.full_like(case["query"], float("nan"))
        want = _attend(case, "torch", max_seqlen_q=1, max_seqlen_k=144)
        for length in (144, 145, 144, 2 ** 40, 144):
            out.fill_(float("nan"))
            if length > 144:
                hits = cache.hits
                with pytest.raises(ValueError, match=rf"max_seqlen_k={length} must be in "
                                   r"\[0, 144\] \(block_table columns 9 x block_size 16\)"):
                    _attend(case, "triton", max_seqlen_q=1, max_seqlen_k=length, out=out)
                # 145 is a hit sent back to the checks; 2 ** 40, of another bucket, a miss.
                assert cache.hits == hits + (length == 145)
                assert out.isnan().all(), f"max_seqlen_k={length} wrote the output"
            else:
                got = _attend(case, "triton", max_seqlen_q=1, max_seqlen_k=length, out=out)
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        assert len(cache) == 1


def _normalised_launches(record, case_tensors):
    spans = []
    for tensor in case_tensors:
        storage = tensor.untyped_storage()
        spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    def arg(value):
        if isinstance(value, tuple) and value[:1] == ("ptr",):
            return value if any(start <= value[1] < end for start, end in spans) else "alloc"
        return value
    # Each launch's build by its place among the builds: the same specialisation either way.
    builds = {id(build): index for index, build in enumerate(record.builds)}
    return [(launch.build.kernel, builds[id(launch.build)], launch.grid,
             tuple(map(arg, launch.args))) for launch in record.launches]


def _decode_loop_calls():
    """``(case, kwargs)`` per call: decode loops over growing lengths (the tuned config, splits
    of 128 keys over two buckets, a window of 200 keys) and mixed steps whose queries grow."""
    calls = []
    case = _paged_case([520, 500], block_size=64, columns=12)
    split_128 = KernelConfig.make(BLOCK_N=64, SPLIT_TOKENS=128, num_warps=4)
    for max_seqlen_k in list(range(250, 262)) + list(range(380, 392)) + list(range(505, 521)):
        for config, window in ((None, 0), (split_128, 0), (split_128, 200)):
            calls.append((case, dict(max_seqlen_q=1, max_seqlen_k=max_seqlen_k, config=config,
                                     window=window)))
    # Mixed steps of one decode request and a prefill chunk in a buffer of 1 + 96 tokens.
    for step, queries in enumerate((2, 3, 40, 70, 96, 3, 65)):
        mixed = _paged_case([300 + step, 200 + queries], block_size=64, columns=12, seed=step)
        mixed["query"] = torch.randn(97, HEADS, DIM)
        mixed["cu_query_lengths"] = torch.tensor([0, 1, 1 + queries], dtype=torch.int32)
        calls.append((mixed, dict(max_seqlen_q=queries, max_seqlen_k=300 + step,
                                  num_decode_requests=1)))
    return calls


@pytest.mark.build
@pytest.mark.skipif(not HAS_TRITON or triton_interpreting(),
                    reason="needs triton, compiled (TRITON_INTERPRET unset)")
class TestOnTheStubDriver:
    def test_decode_loops_launch_as_without_plans(self, monkeypatch):
        from dynctx.kernels.stub_driver import stub_driver

        calls = _decode_loop_calls()
        tensors = [t for case, _ in calls for t in case.values()]

        def run_all(planned: bool):
            monkeypatch.setenv(launch_plan.PLANS_ENV, "1" if planned else "0")
            clear_plans()
            cache = plan_caches()["paged_attention"]
            misses = cache.misses
            with stub_driver() as stub:
                for case, kwargs in calls:
                    _attend(case, "triton", **kwargs)
            return _normalised_launches(stub.record, tensors), cache.misses - misses, cache

        unplanned, _, _ = run_all(False)
        planned, misses, cache = run_all(True)
        assert len(planned) == len(unplanned) and planned == unplanned
        # One plan per (config, window, bucket) of the decode loops, one for the mixed steps:
        # 8 of the 127 calls.
        assert misses == len(cache) == 8, cache
        varied = [plan for plan in cache._plans.values() if len(plan.variants) > 1]
        assert varied, "no plan launched another split or tile count"
        assert all(launch.direct for plan in cache._plans.values() for launch in plan.launches)

    def test_varied_refuses_what_would_change_the_compiled_kernel(self):
        from dynctx.kernels.stub_driver import stub_driver

        clear_plans()
        case = _paged_case([300, 250], block_size=64, columns=12)
        with stub_driver():
            _attend(case, "triton", max_seqlen_q=1, max_seqlen_k=300)
        plan, = plan_caches()["paged_attention"]._plans.values()
        decode = plan.decode
        assert decode.direct
        same = decode.varied(decode.grid, num_splits=7, lse_offset=12345)
        assert same is not None and same._compiled is decode._compiled
        assert same.kwargs["num_splits"] == 7 and decode.kwargs["num_splits"] != 7
        # A 64-bit value: Triton would compile the kernel for an i64 argument.
        assert decode.varied(decode.grid, lse_offset=2 ** 31) is None
        assert decode.varied(decode.grid, num_splits=2.0) is None
        with pytest.raises(ValueError, match="BLOCK_N is no scalar argument"):
            decode.varied(decode.grid, BLOCK_N=32)
        with pytest.raises(ValueError, match="query_ptr is no scalar argument"):
            decode.varied(decode.grid, query_ptr=0)
        # head_dim is specialised (divisible by 16): another value is another kernel.
        assert decode.varied(decode.grid, head_dim=24) is None
