"""Paged attention kernels against torch SDPA on the same data laid out contiguously.

Decode: µs per layer at batch x context (default 1/8/64/256 x 1K/4K/16K), the GB/s of K/V read
(``2 * batch * context * Hkv * D * itemsize`` bytes per call) and its fraction of the HBM
bandwidth (``--hbm-gbps``, the H200's 4,800 by default), next to SDPA (``enable_gqa``) on
``[B, H, L, D]`` contiguous K/V (the ceiling on that machine) and to the published Hopper
figure of about 11 µs at batch 1 / 1K context (FlashInfer, FlashAttention). Prefill: TFLOP/s of
causal prompts (``4 * Hq * D * L^2 / 2`` FLOP per prompt of L tokens) against SDPA
``is_causal``. Llama-3-8B heads (32 query, 8 KV, head dim 128), bf16, blocks of 256 tokens
handed out shuffled.

Each timing is the median over CUDA-graph replays of ``--calls`` launches, each launch on its
own copy of the K/V data ("layers"), enough copies that they do not fit in L2. On a CPU (a
mechanical check of the script, ``--quick``, under ``TRITON_INTERPRET=1``) it times plain calls.
``--json`` is written at the start and after every row (replaced whole; ``"complete": true``
once every row ran), so a run killed at its budget keeps the rows it measured.

    python bench/attention_bench.py --json attention.json          # on the GPU
    TRITON_INTERPRET=1 python bench/attention_bench.py --quick     # on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

L2_BYTES = 64 << 20
PUBLISHED_DECODE_US = 11.0


def versions() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def time_calls(fn, calls: int, device: torch.device, repeats: int = 5) -> float:
    """Median µs of one call of ``fn(i)``, i cycling over ``calls`` launches."""
    for i in range(calls):
        fn(i)
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for i in range(calls):
                fn(i)
            times.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


class PagedLayers:
    """``copies`` layers of a paged K/V cache holding ``batch`` requests of ``context`` tokens,
    and the same K/V contiguous ``[B, Hkv, L, D]`` for SDPA."""

    def __init__(self, *, batch: int, context: int, kv_heads: int, dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, copies: int, contiguous: bool):
        gen = torch.Generator(device="cpu").manual_seed(0)
        blocks_per_request = math.ceil(context / block_size)
        num_blocks = batch * blocks_per_request
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_table = order.view(batch, blocks_per_request).to(device)
        self.kv_seq_lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        shape = (num_blocks, block_size, kv_heads, dim)
        self.key_caches = [torch.randn(shape, device=device, dtype=dtype) for _ in range(copies)]
        self.value_caches = [torch.randn(shape, device=device, dtype=dtype) for _ in range(copies)]
        self.keys, self.values = [], []
        if contiguous:
            index = self.block_table.long()
            for k, v in zip(self.key_caches, self.value_caches):
                # [B, blocks, bs, Hkv, D] -> [B, Hkv, L, D]
                self.keys.append(k[index].flatten(1, 2)[:, :context].transpose(1, 2).contiguous())
                self.values.append(v[index].flatten(1, 2)[:, :context].transpose(1, 2).contiguous())


def decode_rows(args, device, dtype, paged_attention, rows: list, on_row=lambda: None) -> list:
    """Appends one row per (batch, context) to ``rows``, calling ``on_row()`` after each."""
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    item = torch.empty((), dtype=dtype).element_size()
    for batch in args.batch:
        for context in args.context:
            kv_bytes = 2 * batch * context * kv_heads * dim * item
            copies = max(1, min(args.calls, math.ceil(2 * L2_BYTES / kv_bytes)))
            try:
                layers = PagedLayers(batch=batch, context=context, kv_heads=kv_heads, dim=dim,
                                     block_size=args.block_size, dtype=dtype, device=device,
                                     copies=copies, contiguous=not args.no_sdpa)
            except torch.OutOfMemoryError:
                rows.append({"batch": batch, "context": context, "error": "out of memory"})
                on_row()
                continue
            query = torch.randn(batch, heads, dim, device=device, dtype=dtype)
            cu = torch.arange(batch + 1, dtype=torch.int32, device=device)

            def ours(i, layers=layers, query=query, cu=cu, context=context):
                j = i % copies
                paged_attention(query, layers.key_caches[j], layers.value_caches[j], cu,
                                layers.kv_seq_lengths, layers.block_table, max_seqlen_q=1,
                                max_seqlen_k=context, backend=args.backend)

            row = {"batch": batch, "context": context, "kv_bytes": kv_bytes, "copies": copies}
            row["ours_us"] = time_calls(ours, args.calls, device)
            row["ours_gbps"] = kv_bytes / row["ours_us"] / 1e3
            row["ours_hbm_fraction"] = row["ours_gbps"] / args.hbm_gbps
            if not args.no_sdpa:
                q4 = query[:, :, None, :]                                      # [B, Hq, 1, D]

                def sdpa(i, layers=layers, q4=q4):
                    j = i % copies
                    F.scaled_dot_product_attention(q4, layers.keys[j], layers.values[j],
                                                   enable_gqa=True)

                row["sdpa_us"] = time_calls(sdpa, args.calls, device)
                row["sdpa_gbps"] = kv_bytes / row["sdpa_us"] / 1e3
                row["ours_over_sdpa_time"] = row["ours_us"] / row["sdpa_us"]
                # The same answer as SDPA (a GPU-side sanity check; the tests are the real one).
                got = paged_attention(query, layers.key_caches[0], layers.value_caches[0], cu,
                                      layers.kv_seq_lengths, layers.block_table, max_seqlen_q=1,
                                      max_seqlen_k=context, backend=args.backend)
                want = F.scaled_dot_product_attention(q4, layers.keys[0], layers.values[0],
                                                      enable_gqa=True)[:, :, 0]
                row["max_abs_diff_vs_sdpa"] = float((got.float() - want.float()).abs().max())
            rows.append(row)
            on_row()
            print(f"decode batch {batch:>4} ctx {context:>6}: ours {row['ours_us']:9.2f} us "
                  f"{row['ours_gbps']:7.0f} GB/s ({100 * row['ours_hbm_fraction']:4.1f}% HBM)"
                  + (f" | sdpa {row['sdpa_us']:9.2f} us {row['sdpa_gbps']:7.0f} GB/s"
                     f" | max diff {row['max_abs_diff_vs_sdpa']:.1e}"
                     if "sdpa_us" in row else ""), flush=True)
            del layers
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def prefill_rows(args, device, dtype, paged_attention, rows: list, on_row=lambda: None) -> list:
    """Appends one row per prefill shape to ``rows``, calling ``on_row()`` after each."""
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    for prompts, length in args.prefill:
        layers = PagedLayers(batch=prompts, context=length, kv_heads=kv_heads, dim=dim,
                             block_size=args.block_size, dtype=dtype, device=device, copies=1,
                             contiguous=not args.no_sdpa)
        query = torch.randn(prompts * length, heads, dim, device=device, dtype=dtype)
        cu = torch.arange(0, prompts * length + 1, length, dtype=torch.int32, device=device)
        flops = 4 * prompts * heads * dim * length * length / 2

        def ours(i, layers=layers, query=query, cu=cu, length=length):
            paged_attention(query, layers.key_caches[0], layers.value_caches[0], cu,
                            layers.kv_seq_lengths, layers.block_table, max_seqlen_q=length,
                            max_seqlen_k=length, backend=args.backend)

        calls = max(1, args.calls // 8)
        row = {"prompts": prompts, "length": length, "flops": flops}
        row["ours_us"] = time_calls(ours, calls, device)
        row["ours_tflops"] = flops / row["ours_us"] / 1e6
        if not args.no_sdpa:
            q4 = query.view(prompts, length, heads, dim).transpose(1, 2)     # [B, Hq, L, D]

            def sdpa(i, layers=layers, q4=q4):
                F.scaled_dot_product_attention(q4, layers.keys[0], layers.values[0],
                                               is_causal=True, enable_gqa=True)

            row["sdpa_us"] = time_calls(sdpa, calls, device)
            row["sdpa_tflops"] = flops / row["sdpa_us"] / 1e6
            row["ours_over_sdpa_throughput"] = row["ours_tflops"] / row["sdpa_tflops"]
            got = paged_attention(query, layers.key_caches[0], layers.value_caches[0], cu,
                                  layers.kv_seq_lengths, layers.block_table, max_seqlen_q=length,
                                  max_seqlen_k=length, backend=args.backend)
            want = F.scaled_dot_product_attention(q4, layers.keys[0], layers.values[0],
                                                  is_causal=True, enable_gqa=True)
            want = want.transpose(1, 2).reshape(prompts * length, heads, dim)
            row["max_abs_diff_vs_sdpa"] = float((got.float() - want.float()).abs().max())
        rows.append(row)
        on_row()
        print(f"prefill {prompts} x {length:>6}: ours {row['ours_us']:10.1f} us "
              f"{row['ours_tflops']:6.1f} TFLOP/s"
              + (f" | sdpa {row['sdpa_us']:10.1f} us {row['sdpa_tflops']:6.1f} TFLOP/s "
                 f"(ours {row['ours_over_sdpa_throughput']:.2f}x) | max diff "
                 f"{row['max_abs_diff_vs_sdpa']:.1e}" if "sdpa_us" in row else ""),
              flush=True)
        del layers
    return rows


def parse_prefill(text: str) -> tuple[int, int]:
    prompts, length = text.lower().split("x")
    return int(prompts), int(length)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--prefill", type=parse_prefill, nargs="+",
                        default=[(16, 1024), (4, 4096), (1, 16384)],
                        help="PROMPTSxLENGTH causal prefills")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--calls", type=int, default=32, help="launches per timed graph")
    parser.add_argument("--hbm-gbps", type=float, default=4800.0)
    parser.add_argument("--backend", default=None, help="kernel backend (default auto)")
    parser.add_argument("--no-sdpa", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, fp32 (a CPU check of the script under the interpreter)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.prefill = [1, 3], [40, 300], [(2, 40)]
        args.heads, args.kv_heads, args.head_dim, args.block_size = 4, 2, 16, 16
        args.dtype, args.calls = "float32", 2

    from dynctx.kernels.backend import triton_interpreting
    from dynctx.kernels.paged_attention import paged_attention

    if args.backend is None and triton_interpreting():
        args.backend = "triton"

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    result = {"versions": versions(), "device": str(device), "dtype": args.dtype,
              "heads": [args.heads, args.kv_heads, args.head_dim],
              "block_size": args.block_size, "hbm_gbps": args.hbm_gbps,
              "published_decode_us_batch1_1k": PUBLISHED_DECODE_US}
    print(f"paged attention bench on {result['versions'].get('gpu', device)}: {args.dtype}, "
          f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, blocks of {args.block_size}",
          flush=True)
    result["decode"], result["prefill"] = [], []

    def save():
        # After every row, replacing the file whole: a run killed part-way keeps its rows.
        if args.json:
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=2) + "\n")
            os.replace(tmp, args.json)

    save()
    with torch.no_grad():
        decode_rows(args, device, dtype, paged_attention, result["decode"], save)
        prefill_rows(args, device, dtype, paged_attention, result["prefill"], save)
    result["complete"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
