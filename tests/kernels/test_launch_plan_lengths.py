"""Launch plans keyed on what a launch depends on, not on the raw lengths and counts.

Paged attention's plan key holds the classes of ``max_seqlen_q`` and ``max_seqlen_k``
(kernels/paged_attention_plan.py): a decode loop, whose ``max_seqlen_k`` grows by one every
step, reuses one plan per bucket of the tuning key and one set of launches per split count.

The launchers with host counts (``step_metadata``, ``compact_requests``, ``last_token_logits``)
key them by class too (the buckets that pick their configs), with a launch per count tuple in
the plan (``launch_plan.CountPlan``).

* under TRITON_INTERPRET=1 (marker ``interpreter``): a decode loop misses once per bucket, and
  every step equals the torch reference; the count launchers over changing counts of fixed
  buffers equal their references; a length or count the checks refuse is still refused on a
  hit (one that the key's class no longer tells apart), with nothing written;
* through the compile-only sm_90 driver (marker ``build``): decode loops (split counts changing
  inside a bucket, a window, buckets crossed), mixed steps (query tiles changing) and the
  count launchers over changing counts launch the same builds, grids and arguments with plans
  as without, most of them from varied launches, one plan per class;
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


# (max_seqlen_q, max_seqlen_k, num_decode_requests, window) -> the plan key's classes, in
# this order: each call changes one argument of the last (to a value the last call had in
# another place where it can), so a cached answer given for the wrong arguments shows.
LENGTH_CLASSES = [
    ((1, 5, 0, 0), (1, 8)), ((1, 20, 0, 0), (1, 32)), ((20, 20, 0, 0), ("more", "positive")),
    ((20, 20, 1, 0), ("more", 32)), ((1, 20, 1, 0), (1, 32)), ((1, 20, 1, 1), (1, 1)),
    ((1, 1, 0, 0), (1, 1)), ((1, 2, 0, 0), (1, 2)), ((1, 4, 0, 5), (1, 4)),
    ((1, 5, 0, 5), (1, 8)), ((1, 40, 0, 5), (1, 8)), ((2, 40, 3, 5), ("more", 8)),
    ((2, 1, 1, 0), ("more", 1)),
    # not positive ints (or a negative or non-int window): the values themselves
    ((0, 5, 0, 0), (0, 5)), ((1, 0, 0, 0), (1, 0)), ((-1, 5, 0, 0), (-1, 5)),
    ((1, 5, 0, -1), (1, 5)), ((1, 5, 0, 0.0), (1, 5)), ((1.0, 5, 0, 0), (1.0, 5)),
]


@pytest.mark.interpreter   # (pure Python: marked to run beside the plan tests it backs)
def test_length_classes_follow_the_keys_walked_and_keep_the_last_answer():
    """The decode kernel's lengths by the bucket of the keys it walks (a window bounds them),
    the varlen kernel's alone by "positive", anything else as it is; and the same argument
    objects again get the very answer of the last call."""
    from dynctx.kernels.paged_attention_plan import length_classes

    for args, expected in LENGTH_CLASSES:
        assert length_classes(*args) == expected, args
    first = length_classes(1, 300, 0, 0)
    assert first == (1, 512) and length_classes(1, 300, 0, 0) is first


@pytest.mark.interpreter
@pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1")
class TestUnderTheInterpreter:
    @pytest.mark.parametrize("config", [None, KernelConfig.make(BLOCK_N=16, SPLIT_TOKENS=16,
                                                                num_warps=4)],
                             ids=["tuned", "splits_of_16"])
    def test_a_decode_loop_plans_once_per_bucket(self, config):
        """``max_seqlen_k`` from 120 to 152 crosses the bucket 128 -> 256: two plans. In
        splits of 128 keys (the interpreter's default config) each launches one split count;
        in splits of 16 the plan of 256 launches two (9: 129 to 144 keys, 10: 145 and more),
        the second varied from the first."""
        clear_plans()
        cache = plan_caches()["paged_attention"]
        case = _paged_case([120, 113], columns=10)
        misses, counts = 0, set()
        for step, max_seqlen_k in enumerate(range(120, 153)):
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
        assert sorted(len(plan.variants) for plan in plans) == ([1, 1] if config is None
                                                                else [1, 2])

    def test_a_varied_split_count_sizes_the_workspace_by_requests(self):
        """Three decode requests over two KV heads (the decode grid's first two axes differ),
        splits of 16 keys: 40 keys take 3 splits, 50 keys 4, both in the bucket of 64, so the
        second call varies the plan's launches, and its workspace and the merge's offset into
        it follow the requests, not the heads. Both calls equal the reference."""
        clear_plans()
        cache = plan_caches()["paged_attention"]
        case = _paged_case([50, 45, 33], columns=4)
        config = KernelConfig.make(BLOCK_N=16, SPLIT_TOKENS=16, num_warps=4)
        for max_seqlen_k in (40, 50):
            case["kv_seq_lengths"] = torch.tensor([max_seqlen_k, max_seqlen_k - 5, 33],
                                                  dtype=torch.int32)
            got = _attend(case, "triton", max_seqlen_q=1, max_seqlen_k=max_seqlen_k,
                          config=config)
            want = _attend(case, "torch", max_seqlen_q=1, max_seqlen_k=max_seqlen_k)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        (plan,) = cache._plans.values()
        assert sorted(plan.variants) == [(3, 0), (4, 0)]

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

    def test_count_launchers_launch_as_without_plans(self, monkeypatch):
        from dynctx.kernels.stub_driver import stub_driver

        calls = _count_calls()
        tensors = [t for _, kwargs in calls for t in kwargs.values()
                   if isinstance(t, torch.Tensor)]

        def run_all(planned: bool):
            monkeypatch.setenv(launch_plan.PLANS_ENV, "1" if planned else "0")
            clear_plans()
            with stub_driver() as stub:
                _run_count_launchers(calls, "triton")
            return _normalised_launches(stub.record, tensors)

        unplanned = run_all(False)
        planned = run_all(True)
        assert len(planned) == len(unplanned) == 10 + 7 + 16
        # (last_token_logits allocates its output per call: its address reads "alloc".)
        assert planned == unplanned
        caches = plan_caches()
        for name, plans in (("step_metadata", 3), ("compact_requests", 3),
                            ("last_token_logits", 6)):
            assert len(caches[name]) == plans, caches[name]
            assert any(len(plan.variants) > 1 for plan in caches[name]._plans.values()), name
            assert all(launch.direct for plan in caches[name]._plans.values()
                       for launch in plan.launches), name

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
        for value in (2 ** 31 - 1, -2 ** 31):   # int32's ends: Triton's i32, the same kernel
            assert decode.varied(decode.grid, lse_offset=value)._compiled is decode._compiled
        # ... as Triton's own specialiser has it (varied skips asking it within int32).
        from dynctx.kernels.kernel_launch import _specialised

        param, _, unspecialised = decode._scalars["lse_offset"]
        assert unspecialised
        assert (_specialised(param, 2 ** 31 - 1) == _specialised(param, -2 ** 31)
                == _specialised(param, 7) != _specialised(param, 2 ** 31))
        assert decode.varied(decode.grid, num_splits=2.0) is None
        with pytest.raises(ValueError, match="BLOCK_N is no scalar argument"):
            decode.varied(decode.grid, BLOCK_N=32)
        with pytest.raises(ValueError, match="query_ptr is no scalar argument"):
            decode.varied(decode.grid, query_ptr=0)
        # head_dim is specialised (divisible by 16): another value is another kernel.
        assert decode.varied(decode.grid, head_dim=24) is None


def _step_calls():
    """kwargs of step_metadata over fixed buffers (outputs poisoned with -7): decode and mixed
    steps whose counts change (requests, paused rows, tokens, padding)."""
    rows, max_blocks, tokens = 12, 6, 40
    gen = torch.Generator().manual_seed(3)
    buffers = dict(
        block_table=torch.randint(0, 50, (rows, max_blocks), generator=gen, dtype=torch.int32),
        kv_offsets=torch.randint(0, 20, (rows,), generator=gen, dtype=torch.int32),
        next_tokens=torch.randint(0, 1000, (rows,), generator=gen),
        prompt_tokens=torch.randint(0, 1000, (tokens,), generator=gen),
        attn_block_table=torch.full((rows, max_blocks), -7, dtype=torch.int32),
        **{name: torch.full((tokens,), -7, dtype=torch.int64) for name in _token_outputs()})
    calls = []
    # (requests, decode rows, query length of each prefill row, padded tokens, padded rows,
    # paused rows)
    for n, decode, prefill, padded_tokens, padded_requests, paused in (
            (5, 5, 0, 8, 6, 0), (6, 6, 0, 8, 6, 1), (7, 7, 0, 8, 8, 0), (5, 5, 0, 8, 6, 2),
            (6, 4, 3, 16, 8, 0), (6, 3, 2, 16, 8, 1), (7, 5, 4, 16, 8, 0), (6, 4, 3, 16, 8, 0),
            # A mixed step in the decode steps' buckets: another class (its own config).
            (6, 4, 1, 8, 8, 0), (6, 6, 0, 8, 8, 0)):
        lengths = torch.tensor([1] * decode + [prefill] * (n - decode), dtype=torch.int32)
        cu = torch.zeros(rows + 1, dtype=torch.int32)
        cu[1:n + 1] = lengths.cumsum(0)
        query_lengths = torch.zeros(rows, dtype=torch.int32)
        query_lengths[:n] = lengths
        calls.append(dict(buffers, query_lengths=query_lengths, cu_query_lengths=cu,
                          num_requests=n, num_decode=decode, active_tokens=int(cu[n]),
                          padded_tokens=padded_tokens, padded_requests=padded_requests,
                          row_offset=paused, block_size=4, dummy_block=99))
    return calls


def _token_outputs():
    from dynctx.kernels.step_metadata import TOKEN_OUTPUTS

    return TOKEN_OUTPUTS


def _compact_calls():
    """kwargs of compact_requests over fixed buffers, its counts changing."""
    rows, columns = 10, 5
    gen = torch.Generator().manual_seed(4)
    dst = dict(dst_block_table=torch.full((rows, columns), -7, dtype=torch.int32),
               dst_next_tokens=torch.full((rows,), -7, dtype=torch.int64))
    calls = []
    for offset, num_rows, clear_rows in ((0, 5, 5), (0, 6, 6), (2, 6, 8), (0, 7, 7),
                                         (1, 5, 9), (0, 6, 6), (0, 3, 3)):
        calls.append(dict(
            dst, src_block_table=torch.randint(0, 50, (rows, columns), generator=gen,
                                               dtype=torch.int32),
            src_next_tokens=torch.randint(0, 1000, (rows,), generator=gen),
            new_tokens=torch.randint(0, 1000, (rows,), generator=gen),
            plan_src=torch.randperm(rows, generator=gen).to(torch.int32),
            plan_append_col=torch.randint(-1, columns, (rows,), generator=gen,
                                          dtype=torch.int32),
            plan_append_block=torch.randint(0, 50, (rows,), generator=gen, dtype=torch.int32),
            new_token_offset=offset, num_rows=num_rows, clear_rows=clear_rows))
    return calls


def _logits_calls():
    """kwargs of last_token_logits over fixed logits, the request count changing."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 40, generator=gen)
    cu = torch.tensor([0, 1, 2, 4, 5, 7, 8, 9, 11, 12, 13, 14, 15], dtype=torch.int32)
    return [dict(logits=logits, cu_query_lengths=cu, num_requests=n, log_softmax=log_softmax)
            for n in (3, 4, 5, 8, 6, 12, 9, 3) for log_softmax in (False, True)]


def _count_calls() -> list:
    """``(launcher name, kwargs)`` of every call of the three count launchers, in order."""
    return ([("step_metadata", kwargs) for kwargs in _step_calls()]
            + [("compact_requests", kwargs) for kwargs in _compact_calls()]
            + [("last_token_logits", kwargs) for kwargs in _logits_calls()])


_STEP_OUTPUTS = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                 "token_to_block_idx", "token_to_position_in_request",
                 "token_to_local_position_within_kv_block", "attn_block_table")


def _run_count_launchers(calls, backend) -> list:
    """Each call in order; after each, a copy of what it wrote."""
    from dynctx import kernels

    written = []
    for name, kwargs in calls:
        result = getattr(kernels, name)(**kwargs, backend=backend)
        outputs = (_STEP_OUTPUTS if name == "step_metadata" else
                   ("dst_block_table", "dst_next_tokens") if name == "compact_requests" else ())
        written.append({output: kwargs[output].clone() for output in outputs}
                       if outputs else {"rows": result})
    return written


@pytest.mark.interpreter
@pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1")
class TestCountLaunchersUnderTheInterpreter:
    def test_changing_counts_reuse_plans_and_match_the_reference(self):
        clear_plans()
        got = _run_count_launchers(_count_calls(), "triton")
        want = _run_count_launchers(_count_calls(), "torch")
        for index, (mine, theirs) in enumerate(zip(got, want)):
            for name in mine:
                torch.testing.assert_close(mine[name], theirs[name], rtol=1e-6, atol=1e-6,
                                           msg=lambda m, i=index, n=name: f"call {i} {n}: {m}")
        caches = plan_caches()
        # One plan per class: step_metadata's decode and mixed steps (2 buckets of padded
        # tokens), compact_requests' 3 buckets of rows written, last_token_logits' 3 buckets
        # of requests x log_softmax.
        assert len(caches["step_metadata"]) == 3, caches["step_metadata"]
        assert len(caches["compact_requests"]) == 3, caches["compact_requests"]
        assert len(caches["last_token_logits"]) == 6, caches["last_token_logits"]

    def test_counts_refused_by_the_checks_are_refused_on_a_hit(self):
        """Counts of a planned class that the checks refuse go the full path, which refuses
        them with nothing written; the good call right after is a hit."""
        from dynctx.kernels import compact_requests, step_metadata

        clear_plans()
        compact = dict(_compact_calls()[0], dst_block_table=torch.full((6, 5), -7,
                                                                       dtype=torch.int32),
                       dst_next_tokens=torch.full((10,), -7, dtype=torch.int64))
        compact_requests(**compact, backend="triton")
        cache = plan_caches()["compact_requests"]
        for change, message in (
                (dict(num_rows=7, clear_rows=7), "dst_block_table has 6 rows, num_rows/"
                 "clear_rows need 7"),
                (dict(new_token_offset=11), r"new_token_offset=11 must be in \[0, 10\]")):
            before = (compact["dst_block_table"].clone(), compact["dst_next_tokens"].clone())
            hits = cache.hits
            with pytest.raises(ValueError, match=message):
                compact_requests(**{**compact, **change}, backend="triton")
            assert cache.hits == hits + 1, change  # of the plan's class: a hit, refused
            assert torch.equal(compact["dst_block_table"], before[0])
            assert torch.equal(compact["dst_next_tokens"], before[1])
            compact_requests(**compact, backend="triton")
            assert cache.hits == hits + 2

        step = dict(_step_calls()[0], block_table=_step_calls()[0]["block_table"][:5])
        step_metadata(**step, backend="triton")
        before = {name: step[name].clone() for name in _STEP_OUTPUTS}
        cache = plan_caches()["step_metadata"]
        hits = cache.hits
        with pytest.raises(ValueError, match="block_table has 5 rows, needs at least 6"):
            step_metadata(**{**step, "num_requests": 6, "num_decode": 6, "active_tokens": 6},
                          backend="triton")
        assert cache.hits == hits + 1
        assert all(torch.equal(step[name], before[name]) for name in _STEP_OUTPUTS)
