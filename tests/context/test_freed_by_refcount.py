"""A context and its KV buffer are freed by reference counting alone (issue 19 §1): no part of
it refers back to the context or to another part in a cycle, which would keep several GiB of
device memory alive until a ``gc.collect()`` (a GPU bench that builds contexts one after another
would run out of memory part-way). The garbage collector is off for each test: only reference
counting can free what the test lets go of."""

import gc
import weakref

import pytest
import torch
from helpers import BLOCK, GIB, add, request, step
from test_hybrid import make_hybrid

from dynctx.context import DynamicInferenceContext


def plain(**overrides):
    args = dict(params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
                max_sequence_length=64, buffer_size_gb=40 * BLOCK / GIB,
                paused_buffer_size_gb=8 * BLOCK / GIB, block_size_tokens=4, max_tokens=64,
                max_requests=8, unified_memory_level=0, device="cpu")
    args.update(overrides)
    return DynamicInferenceContext(**args)


KINDS = {
    "plain": plain,
    "prefix-caching-lru": lambda: plain(enable_prefix_caching=True,
                                        prefix_caching_eviction_policy="lru"),
    "hybrid": make_hybrid,
    "hybrid-prefix-caching": lambda: make_hybrid(enable_prefix_caching=True,
                                                 prefix_caching_mamba_gb=1e-4),
}


@pytest.fixture
def no_gc():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


def _use(ctx) -> None:
    """Run every part: requests with a shared prefix, steps, a pause-free decode, a finish, the
    handed-out views, a suspend and a resume."""
    for rid in (1, 2):
        add(ctx, request(rid, 9))
    step(ctx)
    step(ctx)
    _ = (ctx.request_ids, ctx.request_to_kv_block_ids, ctx.request_metadata, ctx.paused_tokens,
         ctx.get_kvcache_utilization_stats(), ctx.block_allocator.get_active_used(),
         ctx.token_to_input_ids)
    if ctx.is_hybrid_model:
        _ = ctx.mamba_metadata.request_to_mamba_state_idx
    step(ctx, finished_ids={1})
    ctx.deallocate_all_tensors()
    ctx.allocate_all_tensors(is_init=False)
    add(ctx, request(3, 5))
    step(ctx)


@pytest.mark.parametrize("kind", list(KINDS))
def test_context_and_kv_buffer_freed_by_reference_counting(no_gc, kind):
    ctx = KINDS[kind]()
    _use(ctx)
    watched = {"context": ctx, "KV buffer": ctx.memory_buffer, "request table": ctx._table,
               "block allocator": ctx.block_allocator, "device state": ctx._device,
               "block table": ctx._device.block_table}
    if ctx.prefix_cache is not None:
        watched["prefix cache"] = ctx.prefix_cache
    if ctx.is_hybrid_model:
        watched.update({"Mamba states": ctx.mamba_conv_states, "Mamba metadata":
                        ctx.mamba_metadata})
    refs = {name: weakref.ref(obj) for name, obj in watched.items()}
    del watched, ctx
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert alive == [], f"still alive without the garbage collector: {alive}"
