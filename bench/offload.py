"""KV offload under memory pressure: evicted requests swap to host memory or recompute, and the
prefix cache's host tier keeps shared prefixes that exceed the device pool; same run.

The swap workload (defaults): 16 requests of a 48-token prompt and 48 new tokens each (6 blocks of
16 tokens per request at the end, 96 blocks in all), greedy, all queued at once, through the
reference ``Engine`` on a CPU (one torch thread) with a device pool of 48 blocks (2 of them the
paused budget): the working set is twice the device pool, so requests pause and get evicted.
It runs twice on a tiny random Llama, ``kv_offload_gb=0`` (evicted requests recompute their
prompt and generated tokens) and a host pool of ``--host-blocks`` blocks (they swap to the host
and back, docs/SEMANTICS.md §21), and reports for each: the evictions, the prompt tokens
recomputed (prompt tokens computed beyond each prompt once; the goal: at least 90 % fewer
with offload), the tokens restored from the host, the wall time, and whether every request's
generated tokens are identical between the two runs.

The prefix workload (defaults): 24 requests, each one of 6 shared 64-token prefixes (4 blocks
of 16; taken round robin, the order that defeats a least-recently-used cache) and an 8-token
suffix of its own, 8 new tokens each, one request arriving per step, with prefix caching
("lru") in a device pool of 16 blocks (2 of them the paused budget): the shared prefixes (24
blocks) exceed the device pool. It runs twice with the same host pool of ``--prefix-host-blocks``
blocks, ``prefix_caching_host_tier=False`` (a cached block the device reuses is gone) and True
(it spills to the host and a later hit copies it back, docs/SEMANTICS.md §21), and reports for
each: the prefix cache's hit rate (new requests that matched a block) and token hit rate, the
prompt tokens computed and recomputed (beyond each distinct prompt token once), the blocks
spilled and restored, the wall time (the faster of two runs), and whether the outputs are
identical.

Usage::

    python bench/offload.py                        # prints both tables
    python bench/offload.py --workloads prefix     # the prefix workload only
    python bench/offload.py --requests 4 --new-tokens 8   # a quick run

Results are written only where ``--json`` points.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tiny_llama(max_positions: int, hidden: int = 64, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions)
    return LlamaForCausalLM(config).eval()


def block_gib(hf, block_size: int, blocks: int) -> float:
    config = hf.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_block = 4 * 2 * config.num_hidden_layers * block_size * config.num_key_value_heads \
        * head_dim
    return blocks * per_block / 1024 ** 3


def run(hf, args, host_blocks: int) -> dict:
    from dynctx.context import DynamicInferenceRequest, SamplingParams
    from dynctx.engine import Engine

    bs = args.block_size
    engine = Engine.from_transformers(
        hf, block_size_tokens=bs, buffer_size_gb=block_gib(hf, bs, args.device_blocks),
        paused_buffer_size_gb=block_gib(hf, bs, args.paused_blocks), max_tokens=args.max_tokens,
        kernel_backend="torch", attention_backend="torch", cuda_graphs=False,
        kv_offload_gb=block_gib(hf, bs, host_blocks) if host_blocks else 0)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (args.prompt,), generator=generator).tolist()
               for _ in range(args.requests)]
    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=list(prompt),
        sampling_params=SamplingParams(temperature=1.0, top_k=1,
                                       num_tokens_to_generate=args.new_tokens))
        for i, prompt in enumerate(prompts)]
    start = time.perf_counter()
    results = engine.generate_requests(requests)
    wall = time.perf_counter() - start
    ctx = engine.context
    stats = ctx.get_kv_offload_stats()
    return dict(
        host_blocks=host_blocks, evictions=engine.stats.evictions,
        prompt_tokens_computed=ctx.lifetime_prefill_token_count,
        prompt_tokens_recomputed=ctx.lifetime_prefill_token_count - args.requests * args.prompt,
        tokens_restored=stats.get("kv_offload_restored_tokens", 0),
        requests_restored=stats.get("kv_offload_restored_requests", 0),
        requests_dropped=stats.get("kv_offload_dropped_requests", 0), wall_s=round(wall, 3),
        outputs={r.request_id: r.generated_tokens for r in results})


def run_prefix(hf, args, host_tier: bool) -> dict:
    from dynctx.context import DynamicInferenceRequest, SamplingParams
    from dynctx.engine import Engine

    bs = args.block_size
    engine = Engine.from_transformers(
        hf, block_size_tokens=bs, buffer_size_gb=block_gib(hf, bs, args.prefix_device_blocks),
        paused_buffer_size_gb=block_gib(hf, bs, args.paused_blocks), max_tokens=args.max_tokens,
        kernel_backend="torch", attention_backend="torch", cuda_graphs=False,
        enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
        kv_offload_gb=block_gib(hf, bs, args.prefix_host_blocks),
        prefix_caching_host_tier=host_tier)
    prompts = prefix_prompts(args)
    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=list(prompt),
        sampling_params=SamplingParams(temperature=1.0, top_k=1,
                                       num_tokens_to_generate=args.prefix_new_tokens))
        for i, prompt in enumerate(prompts)]
    start = time.perf_counter()
    results = engine.generate_requests(requests, arrival_steps=list(range(len(requests))))
    wall = time.perf_counter() - start
    ctx = engine.context
    cache, stats = ctx.get_prefix_cache_stats(), ctx.get_kv_offload_stats()
    distinct = len({tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)})
    return dict(
        host_tier=host_tier, hit_rate=round(cache["prefix_cache_hit_rate"], 4),
        token_hit_rate=round(cache["prefix_cache_token_hit_rate"], 4),
        hits=cache["prefix_cache_hits"], lookups=cache["prefix_cache_lookups"],
        prompt_tokens_computed=ctx.lifetime_prefill_token_count,
        prompt_tokens_recomputed=ctx.lifetime_prefill_token_count - distinct,
        blocks_spilled=stats.get("kv_offload_prefix_spilled_blocks", 0),
        blocks_restored=stats.get("kv_offload_prefix_restored_blocks", 0),
        evictions=engine.stats.evictions, wall_s=round(wall, 3),
        outputs={r.request_id: r.generated_tokens for r in results})


def prefix_prompts(args) -> list:
    generator = torch.Generator().manual_seed(2)
    length = args.prefix_blocks * args.block_size
    prefixes = [torch.randint(3, 256, (length,), generator=generator).tolist()
                for _ in range(args.prefixes)]
    return [prefixes[i % args.prefixes]
            + torch.randint(3, 256, (args.suffix,), generator=generator).tolist()
            for i in range(args.prefix_requests)]


def swap_workload(hf, args) -> dict:
    off, on = run(hf, args, 0), run(hf, args, args.host_blocks)
    identical = off.pop("outputs") == on.pop("outputs")
    recomputed_off = off["prompt_tokens_recomputed"]
    fewer = (1 - on["prompt_tokens_recomputed"] / recomputed_off) if recomputed_off else None
    working_set = args.requests * -(-(args.prompt + args.new_tokens) // args.block_size)
    print(f"swap: working set {working_set} blocks, device pool {args.device_blocks} blocks "
          f"({args.paused_blocks} paused), host pool {args.host_blocks} blocks")
    print(f"{'offload':>8} {'evictions':>9} {'recomputed':>10} {'restored':>8} {'wall s':>7}")
    for name, row in (("off", off), ("on", on)):
        print(f"{name:>8} {row['evictions']:>9} {row['prompt_tokens_recomputed']:>10} "
              f"{row['tokens_restored']:>8} {row['wall_s']:>7}")
    print(f"prompt tokens recomputed: {'n/a' if fewer is None else f'{100 * fewer:.1f} %'} "
          f"fewer with offload; outputs identical: {identical}")
    return dict(identical=identical, recomputed_fewer=fewer, working_set_blocks=working_set,
                off=off, on=on)


def prefix_workload(hf, args) -> dict:
    rows = {}
    for _ in range(2):   # the faster of two runs each, interleaved (the first warms up)
        for host_tier in (False, True):
            row = run_prefix(hf, args, host_tier)
            if host_tier in rows:
                row["wall_s"] = min(row["wall_s"], rows[host_tier]["wall_s"])
            rows[host_tier] = row
    off, on = rows[False], rows[True]
    identical = off.pop("outputs") == on.pop("outputs")
    shared = args.prefixes * args.prefix_blocks
    print(f"prefix: {args.prefixes} shared prefixes of {args.prefix_blocks} blocks ({shared} "
          f"blocks), device pool {args.prefix_device_blocks} blocks, host pool "
          f"{args.prefix_host_blocks} blocks")
    print(f"{'host tier':>9} {'hit rate':>8} {'token hit':>9} {'computed':>8} "
          f"{'recomputed':>10} {'spilled':>7} {'restored':>8} {'wall s':>7}")
    for name, row in (("off", off), ("on", on)):
        print(f"{name:>9} {row['hit_rate']:>8} {row['token_hit_rate']:>9} "
              f"{row['prompt_tokens_computed']:>8} {row['prompt_tokens_recomputed']:>10} "
              f"{row['blocks_spilled']:>7} {row['blocks_restored']:>8} {row['wall_s']:>7}")
    print(f"outputs identical: {identical}")
    return dict(identical=identical, shared_prefix_blocks=shared, off=off, on=on)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=48, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=48, help="device KV blocks")
    parser.add_argument("--paused-blocks", type=int, default=2, help="the paused budget")
    parser.add_argument("--host-blocks", type=int, default=96, help="host pool blocks")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per step")
    parser.add_argument("--hidden", type=int, default=64, help="the random Llama's width")
    parser.add_argument("--layers", type=int, default=2, help="the random Llama's layers")
    parser.add_argument("--workloads", nargs="+", choices=("swap", "prefix"),
                        default=["swap", "prefix"])
    parser.add_argument("--prefixes", type=int, default=6, help="distinct shared prefixes")
    parser.add_argument("--prefix-blocks", type=int, default=4, help="blocks per prefix")
    parser.add_argument("--suffix", type=int, default=8, help="tokens after each prefix")
    parser.add_argument("--prefix-requests", type=int, default=24)
    parser.add_argument("--prefix-new-tokens", type=int, default=8)
    parser.add_argument("--prefix-device-blocks", type=int, default=16)
    parser.add_argument("--prefix-host-blocks", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    longest = max(args.prompt + args.new_tokens, args.prefix_blocks * args.block_size
                  + args.suffix + args.prefix_new_tokens)
    hf = tiny_llama(longest + 16, args.hidden, args.layers)
    result = dict(args={k: str(v) for k, v in vars(args).items()}, torch=torch.__version__,
                  python=platform.python_version(), git=git_sha())
    if "swap" in args.workloads:
        result.update(swap_workload(hf, args))   # (its keys at the top, as before)
    if "prefix" in args.workloads:
        result["prefix"] = prefix_workload(hf, args)
    result["identical"] = result.get("identical", True) \
        and result.get("prefix", {}).get("identical", True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if outcome["identical"] else 1)
