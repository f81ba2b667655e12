"""A workload whose counts change compiles each kernel config once.

Triton specialises an integer argument equal to 1 or divisible by 16, and a pointer on its
16-byte alignment, so a kernel taking step counts (or a view that starts at a moving row) would
compile a new variant as they change, mid-run. The launchers mark such arguments
``do_not_specialize``; here the compile-only driver of ``kernels/stub_driver.py`` counts the
builds while every tuning's scratch case runs at one config over counts of 1, 2, 5, 16, 33 (and
257 to 600 keys), and the step-metadata kernel over views from a moving first row.
"""

from __future__ import annotations

import pytest
import torch

from dynctx.kernels import autotune, registry
from dynctx.kernels.backend import HAS_TRITON, triton_interpreting

pytestmark = [
    pytest.mark.build,
    pytest.mark.skipif(not HAS_TRITON or triton_interpreting(),
                       reason="needs triton, compiled (TRITON_INTERPRET unset)"),
]

registry.import_kernel_modules(quiet=True)

COUNTS = (1, 2, 5, 16, 33)
# Keys per request: the paged-attention cases size their block table (blocks of 256) from it,
# and a context's table has a fixed width, so these keep it at 2 or 3 columns (a row stride of
# 1 is a specialisation that pays, kept on purpose).
KEY_LENGTHS = (257, 300, 320, 511, 600)
COUNT_FIELDS = ("num_tokens", "num_requests", "num_rows")


def builds_per_kernel(stub) -> dict[str, int]:
    builds: dict[str, int] = {}
    for build in stub.record.builds:
        builds[build.kernel] = builds.get(build.kernel, 0) + 1
    return builds


@pytest.mark.parametrize("name", sorted(autotune.registered()))
def test_changing_counts_compile_each_kernel_once(name):
    from dynctx.kernels.stub_driver import stub_driver

    tuning = autotune.get_tuning(name)
    base = tuning.presets()[0]
    config = tuning.default_config(base)
    # A varlen step of one token is a decode step (it runs the decode kernel).
    counts = COUNTS[1:] + (64,) if name == "paged_attention_varlen" else COUNTS
    with stub_driver() as stub:
        for step, count in enumerate(counts):
            key = {field: (count if field in COUNT_FIELDS else
                           KEY_LENGTHS[step] if field == "max_seqlen_k" else value)
                   for field, value in base.items()}
            tuning.make_case(key, torch.device("cpu")).run(config)
    builds = builds_per_kernel(stub)
    assert builds and all(n == 1 for n in builds.values()), (
        f"{name} at {config} over counts {counts}: builds per kernel {builds}")
    assert len(stub.record.launches) >= len(counts)


def test_step_metadata_views_from_a_moving_row_compile_once():
    """The context passes the rows ``[paused, total)`` of its per-request tensors: a view whose
    start (and so its alignment) moves with the paused count."""
    from dynctx.kernels.step_metadata import TOKEN_OUTPUTS, step_metadata
    from dynctx.kernels.stub_driver import stub_driver

    rows, max_blocks, tokens = 40, 8, 64
    block_table = torch.zeros(rows, max_blocks, dtype=torch.int32)
    per_request = torch.zeros(rows, dtype=torch.int32)
    next_tokens = torch.zeros(rows, dtype=torch.int64)
    outputs = {name: torch.zeros(tokens, dtype=torch.int64) for name in TOKEN_OUTPUTS}
    attn_block_table = torch.zeros(rows, max_blocks, dtype=torch.int32)
    cu = torch.arange(rows + 1, dtype=torch.int32)
    prompt = torch.zeros(tokens, dtype=torch.int64)
    with stub_driver() as stub:
        for paused, active in ((0, 4), (1, 4), (3, 7), (4, 16), (5, 1)):
            total = paused + active
            step_metadata(**outputs, attn_block_table=attn_block_table,
                          block_table=block_table[paused:total],
                          query_lengths=per_request[paused:total],
                          kv_offsets=per_request[paused:total], cu_query_lengths=cu,
                          next_tokens=next_tokens[paused:total], prompt_tokens=prompt,
                          num_requests=active, num_decode=active, active_tokens=active,
                          padded_tokens=active + 3, padded_requests=active + 1,
                          row_offset=paused, block_size=16, dummy_block=99, backend="triton")
    assert builds_per_kernel(stub) == {"_step_metadata_kernel": 1}
