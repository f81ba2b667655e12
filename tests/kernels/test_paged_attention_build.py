"""paged_attention's Triton kernels build for Hopper (sm_90) without a GPU, at Llama-3-8B's heads
(32 query, 8 KV, head dim 128), through Triton's own compiler and the ptxas it ships, with the
shared memory each build needs checked against the H200's per-block limit: every config of both
search spaces in bf16 (the engine's dtype on a GPU), the default configs in fp16 and fp32. A
check for machines without a GPU (``-m slow``; a build takes 2-10 s on a CPU, the bf16 case
several minutes); the compiled kernel tests on CUDA are the real one."""

from __future__ import annotations

import sys

import pytest
import torch

from dynctx.kernels._backend import HAS_TRITON, triton_interpreting
from dynctx.kernels._common import next_pow2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_TRITON or triton_interpreting(),
                       reason="needs triton, compiled (TRITON_INTERPRET unset)"),
]

# sm_90: 227 KiB of shared memory per block.
SHARED_LIMIT = 227 * 1024
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def build(kernel, pointers: dict, constexprs: dict, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name == "softmax_scale" else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.parametrize("dtype", list(TRITON_TYPES), ids=list(TRITON_TYPES.values()))
def test_configs_build_for_sm90(dtype):
    module = sys.modules["dynctx.kernels.paged_attention"]
    name = TRITON_TYPES[dtype]
    group = HEADS // KV_HEADS
    inputs = {"query_ptr": f"*{name}", "key_cache_ptr": f"*{name}",
              "value_cache_ptr": f"*{name}", "cu_query_lengths_ptr": "*i32",
              "kv_seq_lengths_ptr": "*i32", "block_table_ptr": "*i32"}
    shape = {"BLOCK_D": HEAD_DIM, "IEEE_DOT": dtype == torch.float32}
    decode_key = module.paged_attention_decode_tune_key(
        num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
        num_requests=64, max_seqlen_k=4096)
    decode_configs = (module.paged_attention_decode_configs(decode_key)
                      if dtype == torch.bfloat16
                      else [module.paged_attention_decode_default_config(decode_key)])
    for config in decode_configs:
        built = build(module._paged_attention_decode_kernel,
                      {**inputs, "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"},
                      {**shape, **config.kwargs, "BLOCK_G": max(16, next_pow2(group))},
                      config.num_warps, config.num_stages)
        assert built.metadata.shared <= SHARED_LIMIT, f"decode {config}"
    build(module._paged_attention_merge_kernel,
          {"out_ptr": f"*{name}", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
           "cu_query_lengths_ptr": "*i32"}, {"BLOCK_S": 8, "BLOCK_D": HEAD_DIM}, 4, 1)
    varlen_key = module.paged_attention_varlen_tune_key(
        num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
        num_tokens=4096)
    varlen_configs = (module.paged_attention_varlen_configs(varlen_key)
                      if dtype == torch.bfloat16
                      else [module.paged_attention_varlen_default_config(varlen_key)])
    for config in varlen_configs:
        block_g = next_pow2(group)
        built = build(module._paged_attention_varlen_kernel, {**inputs, "out_ptr": f"*{name}"},
                      {**shape, **config.kwargs, "BLOCK_G": block_g,
                       "TILE_TOKENS": max(1, config.kwargs["BLOCK_M"] // block_g)},
                      config.num_warps, config.num_stages)
        assert built.metadata.shared <= SHARED_LIMIT, f"varlen {config}"
