"""An engine is freed by reference counting alone: no part of it holds the engine (async
scheduling held the engine that held it), so its memory goes with its last reference, not at
the next ``gc.collect()``. (A bench that builds a few dozen engines of several GiB on a GPU
would run out of memory otherwise.)"""

from __future__ import annotations

import gc
import weakref

import pytest
from e2e_helpers import build_engine, tiny_llama


@pytest.fixture
def no_gc():
    """The cyclic garbage collector off for the test: what dies, dies by reference counting."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_engine(hf, async_scheduling: bool):
    engine = build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=32,
                          max_sequence_length=64, kernel_backend="torch",
                          async_scheduling=async_scheduling)
    outputs = engine.generate([[3, 4, 5], [6, 7, 8, 9, 10]], max_new_tokens=4, ignore_eos=True)
    assert [len(o) for o in outputs] == [4, 4]
    return engine


def engine_parts(engine) -> dict:
    """Weak references to the engine and each part it is made of."""
    parts = dict(engine=engine, model=engine.model, scheduler=engine.scheduler,
                 stats=engine.stats)
    for name in ("_steps", "_intake", "_delivery", "_async"):
        if getattr(engine, name, None) is not None:
            parts[name] = getattr(engine, name)
    return {name: weakref.ref(part) for name, part in parts.items()}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_engine_and_its_parts_die_with_the_last_reference(no_gc, async_scheduling):
    """The engine, its model adapter, scheduler, intake, step, delivery and (async) overlap
    objects die when the last reference goes, the garbage collector off. What is left of the
    context is garbage (one ``gc.collect()`` frees it): the engine holds nothing of it."""
    engine = run_engine(tiny_llama(seed=2), async_scheduling)
    refs = engine_parts(engine)
    context = weakref.ref(engine.context)
    kv_buffer = weakref.ref(engine.context.memory_buffer)
    del engine
    alive = sorted(name for name, ref in refs.items() if ref() is not None)
    assert not alive, f"still alive without gc: {alive}"
    gc.collect()
    assert context() is None and kv_buffer() is None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_context_and_its_kv_buffer_die_with_the_engine(no_gc, async_scheduling):
    engine = run_engine(tiny_llama(seed=2), async_scheduling)
    context = weakref.ref(engine.context)
    kv_buffer = weakref.ref(engine.context.memory_buffer)
    del engine
    assert context() is None and kv_buffer() is None


def test_the_prefix_cache_host_tier_holds_no_cycle(no_gc):
    """With the prefix cache's host tier (the allocator's on_spill, the snapshots' hook), the
    context, its KV buffer and the tier still die with the engine, the garbage collector
    off."""
    from e2e_helpers import gib_for_blocks

    hf = tiny_llama(seed=2)
    engine = build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=32,
                          max_sequence_length=64, kernel_backend="torch",
                          enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                          kv_offload_gb=gib_for_blocks(hf, 16, 8))
    engine.generate([[3, 4, 5] * 6, [6, 7, 8, 9, 10]], max_new_tokens=4, ignore_eos=True)
    refs = [weakref.ref(x) for x in (engine.context, engine.context.memory_buffer,
                                     engine.context._parts.offload.tier)]
    del engine
    assert [ref() is None for ref in refs] == [True, True, True]
