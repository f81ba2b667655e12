"""Every kernel config builds for Hopper (sm_90) on a CPU, within the H200's limits.

Through the real launchers, with the compile-only driver of ``kernels/stub_driver.py``: the
launcher runs its host path on CPU tensors, Triton compiles the kernel for sm_90 with the ptxas
it ships, and nothing launches. Each tuning's whole search space is built at every preset key,
and every committed config of ``autotune_cache/`` at its own key; each build must have no
register spill (ptxas's count), shared memory within 227 KiB, at most 1024 threads, and each
launch a grid within CUDA's limits.

A build depends on the model dimensions, the dtype and the config, not on the token counts, so
each key is built with its counts made small (``sm90_builds.build_key``) and the scratch buffers
stay small; full-size grids are the launchers' own check (``_common.check_grid``), and the merge
of many splits is built at 2,048 splits below. The builds run in worker processes, one per core
(a few seconds a build on a CPU; Triton's cache, ``~/.triton/cache``, makes a second run fast).
Run by the first process of tests/run_tests.sh (marker ``build``).
"""

from __future__ import annotations

import pytest
import sm90_builds
import torch

from dynctx.kernels import autotune, registry
from dynctx.kernels.backend import HAS_TRITON, triton_interpreting

pytestmark = [
    pytest.mark.build,
    pytest.mark.skipif(not HAS_TRITON or triton_interpreting(),
                       reason="needs triton, compiled (TRITON_INTERPRET unset)"),
]

registry.import_kernel_modules(quiet=True)
TUNINGS = sorted(autotune.registered())
COMMITTED = sorted(str(p) for p in autotune.PACKAGED_DIR.glob("*/*.json"))
JOBS = [("tuning", name) for name in TUNINGS] + [("file", path) for path in COMMITTED]


@pytest.fixture(scope="module")
def reports():
    return sm90_builds.run_jobs(JOBS)


@pytest.mark.parametrize("job", JOBS, ids=[what.rsplit("autotune_cache/", 1)[-1]
                                           for _, what in JOBS])
def test_builds_for_sm90_within_limits(job, reports, record_property):
    report = reports[job]
    assert not report["problems"], f"{job[1]}: " + "; ".join(report["problems"])
    assert report["configs"] > 0 and report["launches"] >= report["configs"]
    record_property("configs", report["configs"])
    record_property("builds", report["builds"])
    print(f"{job[1]}: {report['configs']} configs, {report['builds']} builds, no spill")


def test_merge_of_2048_splits_builds_without_spill():
    """The split-KV merge at 262,144 keys in splits of 128 (2,048 splits, Llama heads, bf16):
    it merges in chunks, so its registers do not grow with the splits."""
    from dynctx.kernels.paged_attention import paged_attention
    from dynctx.kernels.stub_driver import stub_driver

    splits, block_size, heads, kv_heads, dim = 2048, 256, 32, 8, 128
    keys = splits * 128
    # Never launched: empty tensors (no memory touched) of the full size.
    cache = torch.empty(keys // block_size, block_size, kv_heads, dim, dtype=torch.bfloat16)
    query = torch.empty(1, heads, dim, dtype=torch.bfloat16)
    table = torch.arange(keys // block_size, dtype=torch.int32)[None]
    lengths = torch.tensor([keys], dtype=torch.int32)
    config = autotune.KernelConfig.make(BLOCK_N=64, SPLIT_TOKENS=128, num_warps=4)
    with stub_driver() as stub:
        paged_attention(query, cache, cache, torch.tensor([0, 1], dtype=torch.int32), lengths,
                        table, max_seqlen_q=1, max_seqlen_k=keys, config=config,
                        backend="triton")
    problems, usages = sm90_builds._problems(stub)
    assert [launch.grid for launch in stub.record.launches] == [(1, kv_heads, splits),
                                                                (1, heads, 1)]
    assert not problems, problems


@pytest.mark.parametrize("max_seqlen_q", [1, 8], ids=["decode", "varlen"])
def test_fp32_attention_takes_no_tf32_dots(max_seqlen_q):
    """fp32 queries keep IEEE products on the GPU (the fp32 tolerance of the attention tests
    assumes them): their builds hold no TF32 tensor-core instruction, while bf16 builds of the
    same kernels do use tensor cores (so the check can see them). The interpreter computes
    every ``tl.dot`` in numpy, so only the sm_90 build shows the precision."""
    from dynctx.kernels.paged_attention import paged_attention
    from dynctx.kernels.stub_driver import stub_driver

    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.empty(4, 16, 2, 64, dtype=dtype)
        query = torch.empty(max_seqlen_q, 4, 64, dtype=dtype)
        with stub_driver() as stub:
            paged_attention(query, cache, torch.empty_like(cache),
                            torch.tensor([0, max_seqlen_q], dtype=torch.int32),
                            torch.tensor([40], dtype=torch.int32),
                            torch.arange(4, dtype=torch.int32)[None], max_seqlen_q=max_seqlen_q,
                            max_seqlen_k=40, backend="triton")
        attention = [b for b in stub.record.builds if "merge" not in b.kernel]
        assert len(attention) == 1, [b.kernel for b in stub.record.builds]
        found[dtype] = sm90_builds.mma_instructions(attention[0])
    assert not any("TF32" in op for op in found[torch.float32]), found[torch.float32]
    assert found[torch.bfloat16] and all("BF16" in op for op in found[torch.bfloat16]), found
