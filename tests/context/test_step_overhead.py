"""The step-overhead counter of ``bench/step_overhead.py``: its rules on small snippets, and the
per-step counts of both contexts at a small size (counts, never timings, are asserted)."""

import numpy as np
import step_overhead as so  # noqa: E402  (bench/ is on pytest's pythonpath)
import torch


class _Holder:
    """Stands for a context: a device tensor and a numpy host mirror."""

    def __init__(self):
        self.dev = torch.arange(8, dtype=torch.int32)
        self.host = np.zeros(8, dtype=np.int32)


def _count(fn, holder=None):
    holder = holder or _Holder()
    counter = so.OverheadCounter("cpu", roots=[holder])
    with counter.counting():
        fn(holder)
    return counter


def test_views_and_allocations_do_not_count():
    c = _count(lambda h: (h.dev[2:5], h.dev.view(2, 4).t().unsqueeze(0).squeeze(0),
                          h.dev.reshape(4, 2).permute(1, 0), h.dev.detach(), h.dev.expand(2, 8),
                          torch.empty(5, device="cpu"), h.dev[3]))
    assert sum(c.ops.values()) == 0 and sum(c.syncs.values()) == 0, (c.ops, c.syncs)


def test_device_ops_count_and_sync_points():
    def body(h):
        x = h.dev + 1  # 1 op
        x.sum().item()  # 1 op + item
        torch.nonzero(x > 3)  # 2 ops + nonzero
        x[x > 3]  # 2 ops + bool-mask index
        torch.repeat_interleave(x.long())  # 2 ops + sync (no output_size)
        torch.repeat_interleave(x.long(), x.long(), output_size=36)  # 2 casts + 2: no sync
        int(x[0])  # item
        x.tolist()  # readback
        x.cpu().numpy()  # one readback
        torch.tensor([1, 2], device="cpu")  # blocking H2D (counted as an op too)
        torch.tensor([1, 2])  # host tensor: nothing

    c = _count(body)
    assert dict(c.syncs) == {"item": 2, "nonzero": 1, "bool_mask_index": 1,
                             "repeat_interleave": 1, "readback": 2, "blocking_h2d": 1}, c.syncs
    assert sum(c.ops.values()) == 1 + 1 + 2 + 2 + 2 + 4 + 1, c.ops


def test_host_mirror_work_is_free_and_uploads_are_h2d():
    def body(h):
        h.host[:] = 5
        staged = torch.from_numpy(h.host)  # host
        staged + 1  # host work: not counted
        h.dev.copy_(staged)  # H2D copy: 1 op, blocking (no non_blocking=True)
        h.dev.copy_(staged, non_blocking=True)  # 1 op, not blocking
        h.dev[0] = 3  # a scalar fill: 1 op, no H2D
        idx = torch.tensor([1, 2])  # host index tensor
        h.dev[idx]  # device op fed a host tensor: implicit H2D

    c = _count(body)
    assert c.syncs["blocking_h2d"] == 2 and sum(c.syncs.values()) == 2, c.syncs
    assert sum(c.ops.values()) == 4, c.ops


def test_dynctx_launcher_counts_once():
    """A launcher called through a module's globals (as the context calls them) and the
    registered ``dynctx::`` custom op each count as one op, whatever runs inside."""
    import types

    import dynctx.context.dynamic_context  # noqa: F401 (registers the ops)
    from dynctx.kernels.compaction import compact_requests

    assert so._is_registered_op("compact_requests") and so._is_registered_op("step_metadata")
    module = types.ModuleType("fake_context")
    module.compact_requests = compact_requests

    def args(h):
        R, B = 4, 3
        return (torch.full((R, B), -1, dtype=torch.int32),
                torch.arange(R * B, dtype=torch.int32).view(R, B),
                torch.zeros(R, dtype=torch.int64), torch.arange(R, dtype=torch.int64),
                torch.tensor([7, 8], dtype=torch.int64, device="cpu"),
                torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cpu"),
                torch.full((R,), -1, dtype=torch.int32, device="cpu"),
                torch.full((R,), -1, dtype=torch.int32, device="cpu"))

    holder = _Holder()
    a = args(holder)
    counter = so.OverheadCounter("cpu", roots=[holder, a], launcher_modules=[module])
    with counter.counting():
        module.compact_requests(*a, new_token_offset=2, num_rows=4, clear_rows=4)
    assert dict(counter.ops) == {"dynctx::compact_requests": 1}, counter.ops
    assert module.compact_requests is compact_requests  # restored
    counter.reset()
    with counter.counting():
        torch.ops.dynctx.compact_requests(*a, 2, 4, 4)
    assert dict(counter.ops) == {"dynctx::compact_requests": 1}, counter.ops


def test_step_counts_small():
    """Megatron's steady decode step reproduces the syncs docs/SEMANTICS.md §14 counts (2 .item()
    + 1 blocking H2D in initialize_attention_state, 4 .item() in update_requests); ours reads
    back at most one tensor per step and never calls .item()/nonzero (docs/DESIGN.md §2)."""
    result = so.measure_step_overhead(requests=8, steps=6, block_size=16, max_prompt=40,
                                      max_tokens=256, repeats=1)
    meg, ours = result["sides"]["megatron"], result["sides"]["ours"]
    assert meg["steps_steady"] > 0 and meg["steps_crossing"] > 0
    steady = [s for s in meg["per_step"] if s["crossing"] == 0]
    assert all(s["syncs"] == 7 for s in steady), steady
    assert meg["per_call"]["initialize_attention_state"]["ops"]["mean"] == 22
    for step in ours["per_step"]:
        assert step["ops"] <= 6, step
    kinds = ours["sync_kinds_per_step"]
    assert kinds.get("readback", 0) <= 1
    assert kinds.get("item", 0) == 0 and kinds.get("nonzero", 0) == 0
    assert kinds.get("bool_mask_index", 0) == 0
    assert ours["ops"]["max"] < meg["ops"]["min"]
