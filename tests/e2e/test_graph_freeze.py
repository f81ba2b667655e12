"""The stand-in graph replay freezes what a CUDA graph freezes (engine/launch_tape.py,
``LaunchRecorder``): a replay whose launches differ from the capture's in anything a graph bakes
in (a Python scalar, a shape, the address of a tensor that existed before the forward, which
launch made an intermediate, a kernel call's arguments, a Triton grid) fails on a CPU, as its
result would differ from eager on a GPU; a replay that only changes tensor contents passes.

The engine cases plant the bugs of that class that the eager CPU replay used to hide: the
graph's decode-request count, and its attention key bound, read live from the step instead of
frozen from the graph's dimensions."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import build_engine, case_engine_sizes, make_prompts, tiny_llama

from dynctx.engine import graphs
from dynctx.engine.launch_tape import GraphReplayMismatch, LaunchRecorder
from dynctx.engine.replay_inputs import GraphStepContext
from dynctx.kernels.backend import triton_interpreting
from dynctx.kernels.kv_append import kv_append
from dynctx.kernels.last_token_logits import last_token_logits

CASE = dict(block_size=16, blocks=14, paused_blocks=3, max_tokens=32, max_requests=8)


def graph_engine(hf, **kwargs):
    return build_engine(hf, **case_engine_sizes(CASE), kernel_backend="torch",
                        attention_backend="torch_static", num_cuda_graphs=4, **kwargs)


def recorded(fn, *args):
    recorder = LaunchRecorder()
    with recorder:
        fn(*args)
    return recorder.launches


def replay(tape, fn, *args):
    with LaunchRecorder(tape, label="the test graph"):
        return fn(*args)


# ---------------------------------------------------------------- the engine, bugs planted
@pytest.mark.parametrize("mixed", [None, 2], ids=["decode-only", "mixed"])
def test_a_live_decode_request_count_fails_the_replay(monkeypatch, mixed):
    """The planted bug of issue 27: the captured forward's ``num_decode_requests`` read from the
    live step. On a GPU the graph keeps the capture dummies' count; eager uses the step's."""
    monkeypatch.setattr(GraphStepContext, "num_decode_requests",
                        property(lambda self: self._ctx.num_decode_requests))
    hf = tiny_llama(max_positions=128)
    engine = graph_engine(hf, cuda_graph_mixed_prefill_count=mixed)
    mismatch = r"graph .*models/paged_attention_torch\.py:\d+.* captured \d+, now \d+"
    with pytest.raises(GraphReplayMismatch, match=mismatch):
        engine.generate(make_prompts([5, 9, 3], hf.config.vocab_size), max_new_tokens=4,
                        ignore_eos=True)


def test_the_live_attention_key_bound_fails_the_replay(monkeypatch):
    """The step's exact ``max_seqlen_k`` instead of the graph's static bound."""
    monkeypatch.setattr(GraphStepContext, "active_attn_metadata",
                        property(lambda self: self._ctx.active_attn_metadata))
    hf = tiny_llama(max_positions=128)
    engine = graph_engine(hf)
    with pytest.raises(GraphReplayMismatch, match=r"captured \d+, now \d+"):
        engine.generate(make_prompts([5, 9], hf.config.vocab_size), max_new_tokens=4,
                        ignore_eos=True)


def test_the_fixed_engine_replays_every_graph_under_the_check():
    hf = tiny_llama(max_positions=128)
    engine = graph_engine(hf, cuda_graph_mixed_prefill_count=2)
    runner = engine.graph_runner
    assert all(graph.tape for graph in runner.graphs.values())
    kinds = {launch.kind for graph in runner.graphs.values() for launch in graph.tape}
    assert kinds == {"op", "kernel"}
    engine.generate(make_prompts([5, 9, 3, 12], hf.config.vocab_size), max_new_tokens=6,
                    ignore_eos=True)
    assert engine.graph_replays > 0


# ---------------------------------------------------------------- the recorder itself
def scaled_window(x, scale, start):
    return (x * scale)[start:start + 2].sum()


def test_only_tensor_contents_may_change():
    x = torch.arange(6.0)
    tape = recorded(scaled_window, x, 2, 1)
    assert [str(launch.name) for launch in tape] == \
        ["aten.mul.Tensor", "aten.slice.Tensor", "aten.sum.default"]
    x.copy_(torch.randn(6))
    assert replay(tape, scaled_window, x, 2, 1) == (x * 2)[1:3].sum()


@pytest.mark.parametrize("args, match", [
    ((2.5, 1), r"launch 0 \(op aten\.mul\.Tensor .*\) .* in argument 1: captured 2, now 2\.5"),
    ((2, 3), r"launch 1 \(op aten\.slice\.Tensor .*\) .* in argument 2: captured 1, now 3"),
], ids=["scalar", "slice start"])
def test_a_python_scalar_that_changed_is_named_with_both_values(args, match):
    x = torch.arange(6.0)
    tape = recorded(scaled_window, x, 2, 1)
    with pytest.raises(GraphReplayMismatch, match=match):
        replay(tape, scaled_window, x, *args)


def test_a_tensor_at_another_address_or_of_another_shape_is_refused():
    x = torch.arange(6.0)
    tape = recorded(scaled_window, x, 2, 1)
    with pytest.raises(GraphReplayMismatch, match=r"argument 0: captured tensor float32 \[6\] "
                                                  r"strides \[1\] offset 0 at 0x[0-9a-f]+, "
                                                  r"now tensor .* at 0x"):
        replay(tape, scaled_window, x.clone(), 2, 1)
    with pytest.raises(GraphReplayMismatch, match=r"captured tensor float32 \[6\].*now tensor "
                                                  r"float32 \[5\]"):
        replay(tape, scaled_window, x[:5], 2, 1)


def test_an_intermediate_from_another_launch_is_refused():
    x = torch.arange(4.0)

    def pick(first):
        a, b = x + 1, x + 2
        return (a if first else b) * 3

    tape = recorded(pick, True)
    with pytest.raises(GraphReplayMismatch, match=r"captured tensor .* made by launch 0, "
                                                  r"now tensor .* made by launch 1"):
        replay(tape, pick, False)


def test_more_or_fewer_launches_are_refused():
    x = torch.arange(4.0)

    def repeat(times):
        y = x
        for _ in range(times):
            y = y + 1
        return y

    tape = recorded(repeat, 2)
    with pytest.raises(GraphReplayMismatch, match=r"more launches than the capture's 2"):
        replay(tape, repeat, 3)
    with pytest.raises(GraphReplayMismatch, match=r"made 1 launches, the capture 2; the first "
                                                  r"one missing: op aten\.add\.Tensor"):
        replay(tape, repeat, 1)


def test_a_kernel_call_is_one_launch_whose_arguments_are_frozen():
    """The torch reference of a kernel may read data back (a Triton kernel reads device memory
    instead): its operations are not frozen one by one, its arguments are."""
    logits = torch.randn(7, 5)
    cu = torch.tensor([0, 2, 3, 7], dtype=torch.int32)
    tape = recorded(last_token_logits, logits, cu, 3)
    assert [launch.kind for launch in tape] == ["kernel"]
    assert tape[0].name == "dynctx.kernels.last_token_logits.last_token_logits"
    cu.copy_(torch.tensor([0, 1, 5, 6], dtype=torch.int32))   # other lengths: contents only
    assert torch.equal(replay(tape, last_token_logits, logits, cu, 3), logits[[0, 4, 5]])
    with pytest.raises(GraphReplayMismatch, match=r"kernel dynctx\.kernels\.last_token_logits"
                                                  r"\.last_token_logits .* in num_requests: "
                                                  r"captured 3, now 2"):
        replay(tape, last_token_logits, logits, cu, 2)


@pytest.mark.interpreter
@pytest.mark.skipif(not triton_interpreting(), reason="records the Triton interpreter's "
                    "launches (a compiled launch runs no Python to record)")
def test_a_triton_launch_records_its_grid_and_arguments():
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8)
    cache = torch.zeros(2, 4, 4, 2, 8)
    blocks = torch.tensor([0, 0, 1, 3, 2], dtype=torch.int32)
    slots = torch.tensor([0, 1, 3, 2, 0], dtype=torch.int32)
    key_cache, value_cache = cache
    run = lambda: kv_append(key_cache, value_cache, key, value, blocks, slots,  # noqa: E731
                            backend="triton")
    # As the engine warms up before it captures: the first call of a shape plans its launch
    # (kernels/launch_plan.py), the capture and every replay then take the plan.
    run()
    tape = recorded(run)
    launch, = tape
    assert launch.kind == "kernel" and launch.name == "dynctx.kernels.kv_append.kv_append"
    (kernel, grid, args, keywords), = launch.grids
    assert kernel == "_kv_append_kernel" and grid[0] == "tuple" and len(grid) > 1
    slots.copy_(torch.tensor([3, 2, 1, 0, 1], dtype=torch.int32))
    replay(tape, run)
    assert torch.equal(cache[0, 3, 0], key[3]) and torch.equal(cache[1, 0, 2], value[1])


def test_the_stand_in_warms_up_then_records(monkeypatch):
    """Lazy initialisation in the first forward (a table built once) is not part of the tape:
    the recorded forward is the steady one that every replay repeats."""
    hf = tiny_llama(max_positions=128)
    engine = graph_engine(hf, cuda_graphs=False)
    model, built = engine.model, []

    class Lazy:
        vocab_size = model.vocab_size

        def forward(self, ctx, *, last_token_only=True):
            if not built:
                built.append(torch.ones(3) * 2)   # launches in the first forward only
            return model.forward(ctx, last_token_only=last_token_only)

    runner = graphs.StandInGraphRunner(Lazy(), engine.context, last_token_only=True)
    runner.capture_all()
    engine.graph_runner = runner
    engine.generate(make_prompts([4, 6], hf.config.vocab_size), max_new_tokens=3,
                    ignore_eos=True)
    assert sum(runner.replays.values()) > 0
