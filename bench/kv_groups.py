"""KV groups: the KV bytes one request holds at 8K tokens, with and without groups, measured.

A Gemma-3-shaped context (34 attention layers, every sixth full and the other 29 sliding with a
window of 1,024 tokens, blocks of 256 tokens; one KV head of 8 fp32 values: the ratio does not
depend on the head size) is driven with one request through the context's own calls, as the
engine drives it: a prompt in chunks of ``--chunk`` tokens, then decode steps, until it holds
``--tokens`` tokens (K/V writes are left out: what a block holds does not change what is held).
After that update the KV bytes are read from the blocks each group holds
(``ctx.kv_group_usage()``) and, for the baseline, from the same context built with
``kv_groups=False`` (every layer full). Goal (docs/SEMANTICS.md §22): at most
``1/6 + 5/6 * (W + block) / tokens`` of the baseline.

The second case makes every layer windowed (a Mistral-like layout: the same layers, each of
window ``W``): group 0 then holds no layers, and the request's one windowed group must hold at
most ``ceil(W / block) + 1`` blocks once it decodes (``ceil((chunk + W - 1) / block) + 1`` for a
prefill chunk). It reports the blocks held against that bound, the KV bytes against every layer
full, and the bytes the context allocates for its KV against the context without groups.

Usage::

    OMP_NUM_THREADS=1 python -P bench/kv_groups.py            # the figure (a few seconds)
    python -P bench/kv_groups.py --json /tmp/kv_groups.json

Results are written only where ``--json`` points.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import List, Optional

import torch

GEMMA3_LAYERS = 34
GEMMA3_WINDOW = 1024
BLOCK = 256


def gemma3_windows(layers: int = GEMMA3_LAYERS, window: int = GEMMA3_WINDOW
                   ) -> List[Optional[int]]:
    """Gemma 3's layout: five sliding layers, then one full, repeated."""
    return [None if (i + 1) % 6 == 0 else window for i in range(layers)]


def _context(windows: List[Optional[int]], *, kv_groups: bool, block: int, tokens: int,
             chunk: int, head_dim: int):
    from dynctx.context import DynamicInferenceContext

    layers = len(windows)
    layer_block = 2 * block * head_dim * 4          # K and V of one layer's block, fp32
    blocks = math.ceil((tokens + 1) / block) + 2
    return DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=layers, kv_channels=head_dim,
        num_attention_heads=1, max_sequence_length=tokens + block,
        buffer_size_gb=(blocks + 2) * layers * layer_block / 1024 ** 3,
        paused_buffer_size_gb=2 * layers * layer_block / 1024 ** 3, block_size_tokens=block,
        max_tokens=chunk, max_requests=4, unified_memory_level=0, device="cpu",
        kv_layer_windows=windows, kv_groups=kv_groups)


def bytes_at(windows: List[Optional[int]], *, kv_groups: bool, block: int = BLOCK,
             tokens: int = 8192, chunk: int = 2048, decode: int = 64,
             head_dim: int = 8) -> dict:
    """Drive one request to ``tokens`` tokens (``tokens - decode`` of prompt in chunks of
    ``chunk``, then ``decode`` steps); the blocks and KV bytes held after its last update, and
    the most blocks any windowed group held at a step on the way."""
    from dynctx.context import DynamicInferenceRequest, SamplingParams

    ctx = _context(windows, kv_groups=kv_groups, block=block, tokens=tokens, chunk=chunk,
                   head_dim=head_dim)
    prompt = tokens - decode
    req = DynamicInferenceRequest(request_id=1, prompt_tokens=torch.arange(prompt) % 1000,
                                  sampling_params=SamplingParams(num_tokens_to_generate=decode
                                                                 + 2))
    most = 0
    done = 0
    while True:
        if done < prompt:
            length = min(chunk, prompt - done)
            ctx.add_request(req, length)
            req.remaining_prompt_tokens = req.remaining_prompt_tokens[length:]
            req.finished_chunk_token_count += length
            done += length
            ctx.chunked_prefill_request_id = 1 if done < prompt else -1
        ctx.initialize_attention_state()
        usage = ctx.kv_group_usage()
        if usage is not None:
            most = max([most] + usage["held"][1:])
        ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int64))
        cached = int(ctx.request_kv_length_offsets[0])
        if cached >= tokens:
            break
    usage = ctx.kv_group_usage()
    if usage is None:   # one group: every layer keeps every block
        held = ctx.block_allocator.total_count - 1 - ctx.block_allocator.total_avail
        layer_block = ctx.memory_buffer.nbytes // (ctx.memory_buffer.shape[1]
                                                   * ctx.memory_buffer.shape[2])
        usage = dict(windows=[None], layers=[len(windows)], held=[held],
                     block_bytes=[layer_block * len(windows)],
                     held_bytes=held * layer_block * len(windows))
    return dict(usage, cached_tokens=cached, most_windowed_blocks=most)


def figure(*, layers: int = GEMMA3_LAYERS, window: int = GEMMA3_WINDOW, block: int = BLOCK,
           tokens: int = 8192, chunk: int = 2048, decode: int = 64) -> dict:
    """The measured ratio of KV bytes with groups to every layer full, and the goal."""
    windows = gemma3_windows(layers, window)
    kw = dict(block=block, tokens=tokens, chunk=chunk, decode=decode)
    grouped = bytes_at(windows, kv_groups=True, **kw)
    full = bytes_at(windows, kv_groups=False, **kw)
    full_layers = sum(w is None for w in windows)
    goal = (full_layers / layers + (layers - full_layers) / layers
            * (window + block) / tokens)
    # The issue's figure for Gemma 3 (one full layer in six).
    issue_goal = 1 / 6 + 5 / 6 * (window + block) / tokens
    return dict(layers=layers, full_layers=full_layers, window=window, block=block,
                tokens=tokens, grouped=grouped, full=full,
                ratio=grouped["held_bytes"] / full["held_bytes"], goal=goal,
                issue_goal=issue_goal,
                per_request_bound=math.ceil(window / block) + 1)


def all_windowed(*, layers: int = GEMMA3_LAYERS, window: int = GEMMA3_WINDOW,
                 block: int = BLOCK, tokens: int = 8192, chunk: int = 2048,
                 decode: int = 64) -> dict:
    """Every layer windowed: the blocks one request holds at ``tokens`` tokens against
    ``ceil(W / block) + 1``, its KV bytes against every layer full, and the KV bytes each
    context allocates."""
    windows = [window] * layers
    kw = dict(block=block, tokens=tokens, chunk=chunk, decode=decode)
    grouped = bytes_at(windows, kv_groups=True, **kw)
    full = bytes_at(windows, kv_groups=False, **kw)
    sizes = dict(block=block, tokens=tokens, chunk=chunk, head_dim=8)
    allocated = {name: _context(windows, kv_groups=on, **sizes)._kv.nbytes()
                 for name, on in (("grouped", True), ("full", False))}
    return dict(layers=layers, window=window, block=block, tokens=tokens, chunk=chunk,
                grouped=grouped, full=full, held_blocks=grouped["held"][1],
                bound=math.ceil(window / block) + 1,
                chunk_bound=math.ceil((chunk + window - 1) / block) + 1,
                ratio=grouped["held_bytes"] / full["held_bytes"],
                allocated_bytes=allocated,
                allocated_ratio=allocated["grouped"] / allocated["full"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=GEMMA3_LAYERS)
    parser.add_argument("--window", type=int, default=GEMMA3_WINDOW)
    parser.add_argument("--block", type=int, default=BLOCK)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    result = figure(layers=args.layers, window=args.window, block=args.block,
                    tokens=args.tokens, chunk=args.chunk, decode=args.decode)
    g, f = result["grouped"], result["full"]
    print(f"{result['layers']} layers ({result['full_layers']} full, window {result['window']}), "
          f"blocks of {result['block']}, one request at {g['cached_tokens']} tokens")
    print(f"  every layer full: {f['held'][0]} blocks x {f['layers'][0]} layers = "
          f"{f['held_bytes']} bytes")
    print(f"  KV groups:        {g['held']} blocks of groups {g['windows']} (layers "
          f"{g['layers']}) = {g['held_bytes']} bytes; a windowed group held at most "
          f"{g['most_windowed_blocks']} blocks at a step")
    print(f"  ratio {result['ratio']:.4f}; goal {result['goal']:.4f} (the issue's 1/6 + 5/6 "
          f"(W + block) / tokens: {result['issue_goal']:.4f})")
    windowed = all_windowed(layers=args.layers, window=args.window, block=args.block,
                            tokens=args.tokens, chunk=args.chunk, decode=args.decode)
    w = windowed["grouped"]
    print(f"every layer windowed ({windowed['layers']} layers, window {windowed['window']}), "
          f"one request at {w['cached_tokens']} tokens")
    print(f"  blocks held: {windowed['held_blocks']} (bound ceil(W / block) + 1 = "
          f"{windowed['bound']}); at most {w['most_windowed_blocks']} at a step (a chunk's "
          f"bound {windowed['chunk_bound']}); every layer full: {windowed['full']['held'][0]}")
    print(f"  KV bytes held: ratio {windowed['ratio']:.4f} of every layer full; KV bytes "
          f"allocated: {windowed['allocated_bytes']['grouped']} against "
          f"{windowed['allocated_bytes']['full']} without groups "
          f"({windowed['allocated_ratio']:.4f})")
    result["all_windowed"] = windowed
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2, sort_keys=True)
            out.write("\n")
    within = (windowed["held_blocks"] <= windowed["bound"]
              and w["most_windowed_blocks"] <= windowed["chunk_bound"])
    return 0 if result["ratio"] <= result["issue_goal"] and within else 1


if __name__ == "__main__":
    sys.exit(main())
