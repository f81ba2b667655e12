"""Launch plans (kernels/launch_plan.py): a repeat launch replays its key's plan, and nothing else.

Three layers of checks:

* the cache itself: bounded LRU, keys that no plan may cover (a tensor subclass, a tensor as a
  scalar, a wrong type), ``1`` and ``True`` kept apart;
* under TRITON_INTERPRET=1 (marker ``interpreter``): good and bad calls of one shape alternate
  and every bad one is still refused, naming its argument, with nothing written; launches with
  varying counts that reuse plans give what the torch reference gives;
* through the compile-only sm_90 driver (marker ``build``): every registered tuning's scratch
  case, over changing counts that repeat, launches the same compiled kernels with the same
  grids and the same arguments (every parameter, tensors by address) with plans as without
  (``DYNCTX_LAUNCH_PLANS=0``), and its repeats are plan hits that call the compiled kernel
  directly.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from dynctx.kernels import autotune, launch_plan, registry
from dynctx.kernels.autotune import KernelConfig
from dynctx.kernels.backend import BACKEND_ENV, HAS_TRITON, triton_interpreting
from dynctx.kernels.launch_plan import (
    UNCACHEABLE,
    PlanCache,
    clear_plans,
    launch_key,
    plan_caches,
    scalar_meta,
    tensor_meta,
)

registry.import_kernel_modules(quiet=True)


def test_plan_cache_is_a_bounded_lru():
    cache = PlanCache("test_lru", capacity=2)
    cache.put(("a",), 1)
    cache.put(("b",), 2)
    assert cache.get(("a",)) == 1  # "a" is now the most recent
    cache.put(("c",), 3)
    assert len(cache) == 2 and cache.get(("b",)) is None
    assert cache.get(("a",)) == 1 and cache.get(("c",)) == 3
    assert (cache.hits, cache.misses) == (3, 1)
    with pytest.raises(ValueError, match="capacity=0 must be >= 1"):
        PlanCache("test_lru_empty", capacity=0)


def test_keys_no_plan_may_cover_are_none():
    t = torch.zeros(3, 4)
    assert launch_key((t, None), (1, 2.0, "x", None)) is not None
    # A subclass, a non-tensor, a tensor where a scalar goes: every call takes the full path.
    assert tensor_meta(torch.nn.Parameter(t)) is UNCACHEABLE
    assert launch_key((torch.nn.Parameter(t),)) is None
    assert launch_key(([1, 2],)) is None
    assert launch_key((t,), (torch.tensor(1.0),)) is None
    assert launch_key((t,), (), config={"BLOCK": 4}) is None
    assert scalar_meta(1) != scalar_meta(True) and scalar_meta(1) != scalar_meta(1.0)
    cache = PlanCache("test_none_key")
    cache.put(None, "plan")
    assert len(cache) == 0 and cache.get(None) is None


def test_key_sees_dtype_device_shape_strides_and_alignment():
    base = torch.zeros(8, 8)
    key = tensor_meta(base)
    assert tensor_meta(torch.zeros(8, 8)) == key
    assert tensor_meta(base.half()) != key
    assert tensor_meta(torch.zeros(8, 8, device="meta")) != key
    assert tensor_meta(base.t()) != key                      # strides
    assert tensor_meta(torch.zeros(65)[1:].view(8, 8)) != key   # 16-byte alignment


def _guarded_call():
    a, b = torch.zeros(4, 8), torch.zeros(6, dtype=torch.int32)
    return (a, None, b), (3, True, "triton"), None


def _stale_calls(tensors, scalars):
    """Calls that differ from ``(tensors, scalars)`` in one thing a plan depends on."""
    a, none, b = tensors
    return {
        "dtype": ((a.double(), none, b), scalars),
        "strides": ((torch.zeros(8, 4).t(), none, b), scalars),
        "shape": ((torch.zeros(4, 9), none, b), scalars),
        "device": ((torch.zeros(4, 8, device="meta"), none, b), scalars),
        "alignment": ((torch.zeros(33)[1:].view(4, 8), none, b), scalars),
        "a None filled": ((a, torch.zeros(6, dtype=torch.int32), b), scalars),
        "None moved": ((a, b, None), scalars),
        "subclass": ((torch.nn.Parameter(a, requires_grad=False), none, b), scalars),
        "scalar value": (tensors, (4, True, "triton")),
        "True for 1": (tensors, (3, 1, "triton")),
        "float for int": (tensors, (3.0, True, "triton")),
        "tensor for int": (tensors, (torch.tensor(3), True, "triton")),
        "backend": (tensors, (3, True, "torch")),
    }


@pytest.mark.parametrize("guards", [True, False], ids=["guarded", "lru_only"])
def test_a_plan_is_reused_only_by_a_call_of_its_key(guards, monkeypatch, tmp_path):
    """The recent plans' guard (or, without it, the LRU) gives a plan back for the same call,
    and for no call that differs in a dtype, stride, shape, device, alignment, ``None``, a
    scalar's value or type, the config, an environment variable a plan depends on or the
    lookup generation; the same call after each still finds it."""
    if not guards:
        monkeypatch.setattr(launch_plan, "GUARDS", None)
    else:
        assert launch_plan.GUARDS is not None, "this torch's tensor check failed the probe"
    cache = PlanCache(f"test_reuse_{guards}")
    tensors, scalars, config = _guarded_call()
    plan, key = cache.find(tensors, scalars, config)
    assert plan is None and key is not None
    cache.put(key, "plan")
    assert cache.find(tensors, scalars, config) == ("plan", None)
    assert len(cache._recent) == (1 if guards else 0)
    if guards:
        # A hit from the recent list, without the LRU's key.
        with monkeypatch.context() as m:
            m.setattr(cache, "get", lambda key: pytest.fail("the LRU was asked"))
            assert cache.find(tensors, scalars, config) == ("plan", None)
    for what, (other_tensors, other_scalars) in _stale_calls(tensors, scalars).items():
        assert cache.find(other_tensors, other_scalars, config)[0] is None, what
        assert cache.find(tensors, scalars, config) == ("plan", None), what
    assert cache.find(tensors, scalars, KernelConfig.make(BLOCK=4))[0] is None
    for name, value in ((autotune.OVERRIDE_ENV, str(tmp_path)), ("XDG_CACHE_HOME", str(tmp_path)),
                        (BACKEND_ENV, "triton"), ("TRITON_INTERPRET", "1"),
                        (launch_plan.PLANS_ENV, "1")):
        with monkeypatch.context() as m:
            # (Another value than this process has: a plan depends on the value.)
            m.setenv(name, value if os.environ.get(name) != value else value + "0")
            assert cache.find(tensors, scalars, config)[0] is None, name
        assert cache.find(tensors, scalars, config) == ("plan", None), name
    autotune.clear_lookup_cache()
    assert cache.find(tensors, scalars, config)[0] is None


def test_a_promoted_plan_holds_no_tensor_of_its_calls():
    cache = PlanCache("test_holds_none")
    tensors, scalars, config = _guarded_call()
    cache.put(cache.find(tensors, scalars, config)[1], "plan")
    assert cache.find(tensors, scalars, config)[0] == "plan"
    assert len(cache._recent) == (launch_plan.GUARDS is not None)
    refs = [weakref.ref(t) for t in tensors if t is not None]
    del tensors
    assert all(ref() is None for ref in refs)


def test_the_guard_probe_drops_a_check_that_lets_a_difference_through(monkeypatch):
    guards = pytest.importorskip("torch._C._dynamo.guards")
    assert launch_plan._tensor_guards() is not None

    class Lenient:
        def __init__(self, *tensors, **kwargs):
            self.count = len(tensors)

        def check(self, *tensors):
            return len(tensors) == self.count

    monkeypatch.setattr(guards, "TensorGuards", Lenient)
    assert launch_plan._tensor_guards() is None


def test_the_launch_state_follows_what_plans_depend_on(monkeypatch, tmp_path):
    before = launch_plan.launch_state()
    assert launch_plan.launch_state() == before
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path))
    assert launch_plan.launch_state() != before
    monkeypatch.delenv(autotune.OVERRIDE_ENV)
    assert launch_plan.launch_state() == before
    autotune.clear_lookup_cache()
    assert launch_plan.launch_state() != before


def test_the_lookup_state_follows_the_override_folder(monkeypatch, tmp_path):
    before = autotune.lookup_state()
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path))
    assert autotune.lookup_state() != before
    monkeypatch.delenv(autotune.OVERRIDE_ENV)
    assert autotune.lookup_state() == before
    autotune.clear_lookup_cache()
    assert autotune.lookup_state() != before


def test_a_call_that_takes_the_torch_path_builds_no_key(monkeypatch):
    """No plan serves the torch path, so a launcher whose call resolves to it (``"torch"``,
    or ``"auto"`` on a CPU tensor) skips the key: the CPU references pay no launch key per
    call (it cost the decode step ~20 us at 64 requests), and still give the reference."""
    from dynctx.kernels import compaction, step_metadata  # noqa: F401 (their caches)
    from dynctx.kernels.compaction import compact_requests

    keys = []
    real = launch_plan.launch_key
    monkeypatch.setattr(launch_plan, "launch_key",
                        lambda *a, **k: (keys.append(a), real(*a, **k))[1])
    table = torch.arange(12, dtype=torch.int32).view(4, 3)
    tokens = torch.arange(4, dtype=torch.int64)
    plan = [torch.tensor(v, dtype=torch.int32) for v in ([1, 0, 3], [-1] * 3, [-1] * 3)]
    for backend in ("torch", "auto", "torch"):
        dst, dst_tokens = torch.zeros_like(table), torch.zeros_like(tokens)
        compact_requests(dst, table, dst_tokens, tokens, torch.tensor([70, 71]), *plan,
                         new_token_offset=2, num_rows=3, clear_rows=4, backend=backend)
        assert dst[:3].tolist() == [[3, 4, 5], [0, 1, 2], [9, 10, 11]], backend
        assert dst_tokens.tolist() == [1, 0, 71, 0], backend
    assert keys == []
    # A backend name that does not resolve still reaches the launcher's own error.
    with pytest.raises(ValueError, match="not a kernel backend"):
        compact_requests(dst, table, dst_tokens, tokens, torch.tensor([70, 71]), *plan,
                         new_token_offset=2, num_rows=3, clear_rows=4, backend="cuda")


@pytest.mark.interpreter
@pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1")
class TestUnderTheInterpreter:
    @staticmethod
    def _kv_case(n, *, dtype=torch.float32, gen=None):
        gen = gen or torch.Generator().manual_seed(n)
        cache = torch.randn(2, 5, 4, 2, 8, generator=gen, dtype=torch.float32).to(dtype)
        key = torch.randn(n, 2, 8, generator=gen).to(dtype)
        value = torch.randn(n, 2, 8, generator=gen).to(dtype)
        flat = torch.randperm(5 * 4, generator=gen)[:n]
        return cache, key, value, (flat // 4).to(torch.int32), (flat % 4).to(torch.int32)

    def test_bad_calls_of_a_planned_shape_are_still_refused(self):
        from dynctx.kernels import kv_append

        clear_plans()
        cache, key, value, block_ids, slots = self._kv_case(3)
        kv_append(cache[0], cache[1], key, value, block_ids, slots, backend="triton")
        assert len(plan_caches()["kv_append"]) == 1
        bad_calls = [
            ("key dtype torch.float16 != cache dtype", dict(key=key.half())),
            ("block_ids dtype torch.float32 must be int32 or int64",
             dict(block_ids=block_ids.float())),
            ("slots is on meta, key_cache on cpu", dict(slots=slots.to("meta"))),
            ("key_cache is written in place but dim 0 has stride 0",
             dict(key_cache=cache[0][:1].expand(5, 4, 2, 8))),
            ("key has 2 rows, fewer than the 3 tokens", dict(key=key[:2])),
            ("key_scale/value_scale are for an FP8 cache",
             dict(key_scale=torch.ones(2), value_scale=torch.ones(2))),
        ]
        for message, change in bad_calls:
            args = dict(key_cache=cache[0], value_cache=cache[1], key=key, value=value,
                        block_ids=block_ids, slots=slots)
            args.update(change)
            before = cache.clone()
            with pytest.raises(ValueError, match=message.replace("(", r"\(")):
                kv_append(**args, backend="triton")
            assert torch.equal(cache, before), message
            # The good call of the same shape, right after: a hit, and right.
            expected = cache.clone()
            kv_append(expected[0], expected[1], key, value, block_ids, slots, backend="torch")
            kv_append(cache[0], cache[1], key, value, block_ids, slots, backend="triton")
            assert torch.equal(cache, expected), message
        assert plan_caches()["kv_append"].hits >= len(bad_calls)

    def test_overlapping_outputs_of_a_planned_shape_are_still_refused(self):
        """compact_requests' overlap check reads addresses: a call of a planned key whose
        outputs share memory with its inputs is refused, with nothing written."""
        from dynctx.kernels import compact_requests

        clear_plans()
        # Views 16 bytes apart overlap and have the same metadata (alignment included).
        flat = torch.arange(40, dtype=torch.int32)
        tokens = torch.arange(12, dtype=torch.int64)
        new = torch.arange(100, 104, dtype=torch.int64)
        plan = torch.tensor([1, 0, 3, 2], dtype=torch.int32)
        none = torch.full((4,), -1, dtype=torch.int32)

        def call(dst_table, src_table, dst_tokens, src_tokens):
            compact_requests(dst_table, src_table, dst_tokens, src_tokens, new, plan, none, none,
                             new_token_offset=0, num_rows=4, clear_rows=4, backend="triton")

        table = (flat[:12].view(4, 3), flat[16:28].view(4, 3))
        good = (*table, tokens[:4], tokens[4:8])
        bad_calls = {
            "dst_block_table and src_block_table": (table[0], flat[4:16].view(4, 3),
                                                    *good[2:]),
            "dst_next_tokens and src_next_tokens": (*table, tokens[:4], tokens[2:6]),
        }
        call(*good)
        for message, bad in bad_calls.items():
            before = (flat.clone(), tokens.clone())
            with pytest.raises(ValueError, match=f"{message} must not share memory"):
                call(*bad)
            assert torch.equal(flat, before[0]) and torch.equal(tokens, before[1]), message
            hits = plan_caches()["compact_requests"].hits
            call(*good)
            assert plan_caches()["compact_requests"].hits == hits + 1, message

    def test_a_plan_never_serves_the_torch_backend(self, monkeypatch):
        """After a Triton launch planned these arguments, ``backend="torch"`` still runs the
        torch reference (the plan is the Triton path's only)."""
        import importlib

        from dynctx.kernels import compaction

        kv_module = importlib.import_module("dynctx.kernels.kv_append")   # not the function
        clear_plans()
        ran = []
        for module, name in ((kv_module, "kv_append_ref"),
                             (compaction, "compact_requests_ref")):
            real = getattr(module, name)
            monkeypatch.setattr(module, name,
                                lambda *a, _real=real, _name=name, **k: (ran.append(_name),
                                                                         _real(*a, **k)))
        cache, key, value, block_ids, slots = self._kv_case(3)
        for backend in ("triton", "triton", "torch"):
            kv_module.kv_append(cache[0], cache[1], key, value, block_ids, slots,
                                backend=backend)
        table = torch.arange(12, dtype=torch.int32).view(4, 3)
        tokens = torch.arange(4, dtype=torch.int64)
        plan = [torch.tensor(v, dtype=torch.int32) for v in ([1, 0, 3], [-1] * 3, [-1] * 3)]
        for backend in ("triton", "triton", "torch"):
            dst, dst_tokens = torch.zeros_like(table), torch.zeros_like(tokens)
            compaction.compact_requests(dst, table, dst_tokens, tokens,
                                        torch.tensor([70, 71]), *plan, new_token_offset=2,
                                        num_rows=3, clear_rows=4, backend=backend)
            assert dst[:3].tolist() == [[3, 4, 5], [0, 1, 2], [9, 10, 11]], backend
            assert dst_tokens.tolist() == [1, 0, 71, 0], backend
        assert plan_caches()["kv_append"].hits >= 1
        assert plan_caches()["compact_requests"].hits >= 1
        assert ran == ["kv_append_ref", "compact_requests_ref"]

    def test_varying_counts_reusing_plans_match_the_reference(self):
        from dynctx.kernels import kv_append, last_token_logits, mamba_state_gather

        clear_plans()
        for step, n in enumerate((3, 5, 3, 1, 5, 3)):
            gen = torch.Generator().manual_seed(step)
            cache, key, value, block_ids, slots = self._kv_case(n, gen=gen)
            expected = cache.clone()
            kv_append(expected[0], expected[1], key, value, block_ids, slots, backend="torch")
            kv_append(cache[0], cache[1], key, value, block_ids, slots, backend="triton")
            assert torch.equal(cache, expected), f"kv_append, step {step}, n={n}"

            logits = torch.randn(2 * n + 1, 40, generator=gen)
            cu = torch.arange(0, 2 * n + 1, 2, dtype=torch.int32)
            for log_softmax in (False, True):
                got = last_token_logits(logits, cu, n, log_softmax=log_softmax, backend="triton")
                want = last_token_logits(logits, cu, n, log_softmax=log_softmax, backend="torch")
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

            states = torch.randn(7, 3, 5, generator=gen)
            slot_ids = torch.randint(-1, 7, (n,), generator=gen, dtype=torch.int32)
            assert torch.equal(mamba_state_gather(states, slot_ids, backend="triton"),
                               mamba_state_gather(states, slot_ids, backend="torch"))
        caches = plan_caches()
        for name in ("kv_append", "last_token_logits", "mamba_state_gather"):
            assert caches[name].hits > 0, caches[name]

    def test_paged_attention_plans_replay_decode_and_varlen(self):
        from dynctx.kernels import paged_attention

        clear_plans()
        cache, triton_misses = plan_caches()["paged_attention"], 0
        gen = torch.Generator().manual_seed(0)
        heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 12
        key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
        value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
        table = torch.randperm(num_blocks, generator=gen)[:9].view(3, 3).to(torch.int32)
        kv = torch.tensor([5, 9, 7], dtype=torch.int32)
        for step, query_lengths in enumerate(([1, 1, 1], [1, 3, 2], [1, 1, 1], [1, 3, 2])):
            q_len = torch.tensor(query_lengths)
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), q_len.cumsum(0)]).to(torch.int32)
            query = torch.randn(int(q_len.sum()), heads, dim, generator=gen)
            args = dict(max_seqlen_q=max(query_lengths), max_seqlen_k=9,
                        num_decode_requests=1)
            misses = cache.misses
            got = paged_attention(query, key_cache, value_cache, cu, kv, table, **args,
                                  backend="triton")
            triton_misses += cache.misses - misses
            want = paged_attention(query, key_cache, value_cache, cu, kv, table, **args,
                                   backend="torch")
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5,
                                       msg=lambda m, step=step: f"step {step}: {m}")
        # Two keys (all decode, decode + varlen), each planned once and replayed after.
        assert triton_misses == 2


@pytest.mark.build
@pytest.mark.skipif(not HAS_TRITON or triton_interpreting(),
                    reason="needs triton, compiled (TRITON_INTERPRET unset)")
def test_a_planned_launch_feeds_the_launch_hooks():
    """A replayed launch gives Triton's launch hooks (a profiler's) the kernel's metadata, as
    JITFunction.run does, once one has joined the chain."""
    from triton import knobs

    from dynctx.kernels import kv_append
    from dynctx.kernels.stub_driver import stub_driver

    clear_plans()
    cache = torch.zeros(2, 5, 4, 2, 8)
    key, value = torch.zeros(3, 2, 8), torch.zeros(3, 2, 8)
    block_ids, slots = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    with stub_driver():
        for _ in range(3):
            kv_append(cache[0], cache[1], key, value, block_ids, slots, backend="triton")
        hits = plan_caches()["kv_append"].hits
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            kv_append(cache[0], cache[1], key, value, block_ids, slots, backend="triton")
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        kv_append(cache[0], cache[1], key, value, block_ids, slots, backend="triton")
    assert seen == ["_kv_append_kernel"]
    assert plan_caches()["kv_append"].hits == hits + 2


def _storages(obj) -> list[tuple[int, int]]:
    """The storage spans of the tensors a case holds (its inputs and outputs)."""
    values = obj.values() if isinstance(obj, dict) else vars(obj).values()
    spans = []
    for value in values:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        elif isinstance(value, dict):
            spans += _storages(value)
    return spans


def _normalised(launches, spans):
    """Each launch as (kernel, grid, args), a pointer into a case's tensors as its address and
    one into a buffer the launcher allocated as "alloc" (allocations differ from run to run)."""
    def arg(value):
        if isinstance(value, tuple) and value[:1] == ("ptr",):
            inside = any(start <= value[1] < end for start, end in spans)
            return value if inside else "alloc"
        return value
    return [(launch.build.kernel, launch.grid, tuple(map(arg, launch.args)))
            for launch in launches]


@pytest.mark.build
@pytest.mark.skipif(not HAS_TRITON or triton_interpreting(),
                    reason="needs triton, compiled (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("name", sorted(autotune.registered()))
def test_planned_launches_match_unplanned_ones(name, monkeypatch):
    """On the sm_90 stub path: the same kernels, builds, grids and arguments either way."""
    from dynctx.kernels.stub_driver import stub_driver

    tuning = autotune.get_tuning(name)
    base = tuning.presets()[0]
    counts = (2, 5, 2, 5) if name == "paged_attention_varlen" else (1, 2, 5, 2, 1)
    cases = [tuning.make_case({field: min(value, count) if field in (
        "num_tokens", "num_requests", "num_rows") else value for field, value in base.items()},
        torch.device("cpu")) for count in counts]

    def run_all(planned: bool):
        monkeypatch.setenv(launch_plan.PLANS_ENV, "1" if planned else "0")
        clear_plans()
        with stub_driver() as stub:
            for case in cases:
                case.run(None)
                case.run(None)
        return stub.record.launches

    unplanned = run_all(False)
    planned = run_all(True)
    spans = [span for case in cases for span in _storages(case)]
    assert planned and _normalised(planned, spans) == _normalised(unplanned, spans)
    caches = [cache for cache in plan_caches().values() if cache.hits]
    assert caches, f"{name}: no launch was a plan hit"
    for cache in caches:
        for plan in cache._plans.values():
            for launch in _kernel_launches(plan):
                assert launch.direct, f"{name}: {cache.name} replays through Triton's dispatch"


def _kernel_launches(plan):
    if isinstance(plan, launch_plan.KernelLaunch):
        return [plan]
    if isinstance(plan, tuple):
        return [part for part in plan if isinstance(part, launch_plan.KernelLaunch)]
    return list(plan.launches)
