"""A 2 x 2 grid of CPU ranks (tensor-parallel pairs {0, 1}, {2, 3}; pipeline pairs {0, 2},
{1, 3}) over gloo, each rank with its own memory budget: the MIN over the tensor group and then
over the pipeline group gives every rank of the grid the same, smallest, block counts."""

from __future__ import annotations

from types import SimpleNamespace

from distributed_ranks import run_spawned

BLOCK = 4 * 2 * 2 * 4 * 1 * 8       # fp32, K+V, 2 layers, 4 tokens, 1 KV head per rank, dim 8
GIB = 1024 ** 3
# Rank -> (buffer blocks, paused blocks): the smallest of each is on a different rank.
BUDGETS = {0: (40, 9), 1: (33, 7), 2: (36, 5), 3: (50, 8)}


def grid_rank() -> tuple:
    import torch
    import torch.distributed as dist

    from dynctx.context import DynamicInferenceContext

    rank = dist.get_rank()
    # Every rank creates every group, in the same order.
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = SimpleNamespace(tp=tp_groups[rank // 2], pp=pp_groups[rank % 2])
    blocks, paused = BUDGETS[rank]
    ctx = DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
        max_sequence_length=64, buffer_size_gb=blocks * BLOCK / GIB,
        paused_buffer_size_gb=paused * BLOCK / GIB, block_size_tokens=4, max_tokens=64,
        max_requests=8, unified_memory_level=0, device="cpu", pg_collection=groups)
    alloc = ctx.block_allocator
    return (ctx.tensor_model_parallel_size, ctx.pipeline_model_parallel_size,
            ctx.num_attention_heads_per_partition, alloc.total_count, alloc.paused_count)


def test_tensor_and_pipeline_groups_agree_on_the_grid_minimum():
    results = run_spawned(grid_rank, world_size=4, timeout_s=180)
    smallest = (min(b for b, _ in BUDGETS.values()), min(p for _, p in BUDGETS.values()))
    assert smallest == (33, 5)         # from ranks 1 and 2: no single group holds both
    for rank in range(4):
        assert results[rank] == (2, 2, 1, *smallest), rank
