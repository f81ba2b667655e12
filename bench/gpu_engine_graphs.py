"""Engine decode throughput on a GPU, with and without CUDA graphs, against transformers.

A random Llama of about 1.1B parameters (bf16; 16 layers, hidden 2048, 32 query / 8 KV heads,
head dim 64, MLP 8192, vocabulary 32000) decodes ``--new-tokens`` tokens for each of B
requests with ``--prompt-len``-token prompts, at each batch size B of ``--batches`` (default
1, 16, 64, 256), greedily and ignoring EOS, in three modes:

* ``eager``: ``Engine.from_transformers(...)`` without ``num_cuda_graphs``;
* ``graphs``: the same with ``num_cuda_graphs=--num-cuda-graphs``. The context then picks
  Megatron's graph batch dimensions each step (context/graph_ladder.py). Whether the forward
  is really captured and replayed depends on the engine: the script records what the engine
  reports (``graph_info`` in the results) and the share of steps the context ran in a graph
  shape. An engine without capture runs these steps eagerly, padded to the graph's shape;
* ``graphs_async``: ``graphs`` with ``async_scheduling=True`` (engine/overlap.py): each step's
  sampled tokens are read after the next step's forward is launched, so the host's
  bookkeeping overlaps the device's forward; its outputs must equal ``eager``'s;
* ``hf``: ``transformers``' ``generate`` on the same prompts as one padded batch, greedy,
  with ``cache_implementation="static"`` and ``disable_compile=True`` (on CUDA a static cache
  otherwise runs ``torch.compile`` per batch shape, about a minute each). Its decode time is
  ``t(generate N tokens) - t(generate 1 token)`` over ``N - 1`` steps (the prefill and the
  first token cancel).

The engine modes run first, batch by batch, and ``hf`` last, so that a run cut short keeps the
engine's numbers. For the engine modes, only pure decode steps count (every active request
contributes one token); the prefill and chunked-prefill steps are left out. Per mode and batch
it reports decode tokens/s, the median and p90 time of a decode step, and the number of steps
timed. Each (mode, batch) builds one engine (CUDA graphs captured once), warms it up on the
same prompts for ``--warmup-tokens`` tokens (Triton compilation, allocator), then times the
run; ``hf`` warms up with one short ``generate``.

Results go to ``--out`` (JSON: device, versions, model, per-run numbers), written when the
script starts and again after every run (replacing the file whole, so a run killed part-way
leaves a valid file with the runs done), and a table to stdout (and ``--table-file``).
``--max-seconds`` stops starting new runs when the budget is spent (what ran is kept).

On the lent GPU machine it is section 5 of ``bench/device_check.sh`` (batch 1, 64 and 256).
On a CPU, ``--tiny`` runs the same pipeline on a 2-layer fp32 model in a few seconds (the check
that the script works; its numbers mean nothing). Status: the CUDA path has not been run yet
(no GPU when it was written).

Usage::

    python bench/gpu_engine_graphs.py --out $OUT/engine_graphs.json
    python bench/gpu_engine_graphs.py --tiny --device cpu --batches 1,4 --new-tokens 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

MODES = ("eager", "graphs", "graphs_async", "hf")

#: About 1.1B parameters: 16 x (attention 10.5M + MLP 50.3M) + embeddings and head 2 x 65.5M.
MODEL_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=4096)
#: The --tiny stand-in (CPU check of the script).
MODEL_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64,256",
                        help="comma-separated batch sizes (default 1,16,64,256)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens generated per request (the decode steps timed)")
    parser.add_argument("--num-cuda-graphs", type=int, default=16,
                        help="num_cuda_graphs of the 'graphs' mode")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8192,
                        help="the context's token budget per step (prefills are chunked to it)")
    parser.add_argument("--buffer-gb", type=float, default=8.0,
                        help="KV buffer (GiB); 256 x 192 tokens of the 1B model need 1.5 GiB")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="default bfloat16 (float32 with --tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer model (a CPU check of the script, not a measurement)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-tokens", type=int, default=4,
                        help="tokens per request of the warm-up run in each engine (0: none)")
    parser.add_argument("--max-seconds", type=float, default=420.0,
                        help="stop starting new runs after this many seconds")
    parser.add_argument("--out", default="engine_graphs.json", help="JSON results path")
    parser.add_argument("--table-file", default=None,
                        help="also write the table to this file (default: stdout only)")
    args = parser.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        parser.error(f"--batches={args.batches!r} must be comma-separated integers")
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batches={args.batches} must be positive integers")
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    for name in ("prompt_len", "new_tokens", "block_size", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup_tokens < 0:
        parser.error(f"--warmup-tokens={args.warmup_tokens} must be >= 0")
    if args.new_tokens < 2 and "hf" in args.modes:
        parser.error("--new-tokens must be >= 2 for the hf mode (t(N) - t(1) over N - 1 steps)")
    if args.max_tokens < max(args.batches):
        parser.error(f"--max-tokens={args.max_tokens} must be >= the largest batch "
                     f"{max(args.batches)} (every decode request needs a token slot)")
    args.dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    shape = MODEL_TINY if args.tiny else MODEL_1B
    config = LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=args.dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed + batch)
    return torch.randint(1, vocab, (batch, length), generator=gen).tolist()


def _graph_info(engine) -> Dict[str, object]:
    """What the engine says about CUDA graphs (capture lives in the engine, not the context)."""
    info: Dict[str, object] = {}
    for name in ("num_captured_graphs", "captured_graph_count", "graph_replays",
                 "cuda_graph_replays", "uses_cuda_graphs"):
        value = getattr(engine, name, None)
        if value is not None and not callable(value):
            info[name] = value
    runner = getattr(engine, "graph_runner", None)
    if runner is not None:
        info["graph_runner"] = type(runner).__name__
    if not info:
        info["engine"] = "reports no CUDA graph capture: the forward runs eagerly"
    return info


def run_engine(model, prompts, args, device, *, num_cuda_graphs: Optional[int],
               async_scheduling: bool = False) -> dict:
    """One engine over ``prompts``: a warm-up run of ``--warmup-tokens`` tokens each, then the
    timed run of ``--new-tokens``; times the pure decode steps (each computes one token per
    active request; with ``async_scheduling`` a step delivers the step before's)."""
    from dynctx.engine import Engine

    batch = len(prompts)
    engine = Engine.from_transformers(
        model, device=device, params_dtype=args.dtype, block_size_tokens=args.block_size,
        buffer_size_gb=args.buffer_gb, paused_buffer_size_gb=args.buffer_gb / 8,
        max_tokens=args.max_tokens, max_requests=max(batch, 4), unified_memory_level=0,
        num_cuda_graphs=num_cuda_graphs, async_scheduling=async_scheduling)
    try:
        if args.warmup_tokens:
            _drive(engine, prompts, args.warmup_tokens, first_id=batch, device=device)
        return _drive(engine, prompts, args.new_tokens, first_id=0, device=device)
    finally:
        # The next run builds a context of --buffer-gb again: free this one's first.
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _drive(engine, prompts, new_tokens: int, *, first_id: int, device) -> dict:
    """Generate ``new_tokens`` for each prompt (ids from ``first_id``) through ``engine.step``,
    timing the pure decode steps."""
    from dynctx.context import DynamicInferenceRequest, SamplingParams

    batch = len(prompts)
    ctx = engine.context
    decode_times: List[float] = []
    graph_steps = steps = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(DynamicInferenceRequest(
            request_id=first_id + i, prompt_tokens=torch.tensor(prompt, dtype=torch.int64),
            sampling_params=SamplingParams(temperature=1.0, top_k=1,
                                           num_tokens_to_generate=new_tokens,
                                           termination_id=None)))
    replays_before = engine.graph_replays
    _sync(device)
    start = time.perf_counter()
    generated = 0
    results = []
    while engine.has_unfinished_requests():
        result = engine.step()
        # With async scheduling the last tokens and results come with a step that runs no
        # forward (idle).
        results.extend(result.finished)
        if result.idle:
            continue
        steps += 1
        graph_steps += bool(ctx.using_cuda_graph_this_step())
        # A pure decode step: one token per active request (synchronously, the sampled
        # .tolist() syncs; with async scheduling the step before's tokens are read).
        if result.tokens == result.active_requests and result.active_requests:
            decode_times.append(result.time_s)
            generated += result.active_requests
    _sync(device)
    wall = time.perf_counter() - start
    if len(results) != batch or any(r.finish_reason != "length" for r in results):
        raise RuntimeError(f"engine run at batch {batch}: {len(results)} results, reasons "
                           f"{sorted({r.finish_reason for r in results})}")
    outputs = {r.request_id - first_id: r.generated_tokens for r in results}
    info = _graph_info(engine)
    info["graph_replays_this_run"] = engine.graph_replays - replays_before
    return dict(
        decode_steps=len(decode_times), steps=steps, graph_shape_steps=graph_steps,
        decode_tokens=generated,
        tokens_per_s=generated / sum(decode_times) if decode_times else None,
        step_ms_median=1e3 * statistics.median(decode_times) if decode_times else None,
        step_ms_p90=1e3 * _quantile(decode_times, 0.9) if decode_times else None,
        wall_s=wall, graph_info=info,
        ladder=[str(d) for d in ctx.cuda_graph_batch_dimensions_list][:8],
        outputs=[outputs[i] for i in range(batch)])


def run_hf(model, prompts, args, device) -> dict:
    """transformers' generate, static cache, greedy; decode time = t(N) - t(1)."""
    ids = torch.tensor(prompts, dtype=torch.int64, device=device)
    mask = torch.ones_like(ids)

    def generate(n: int):
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            # disable_compile: a static cache otherwise compiles the forward (torch.compile)
            # per batch shape on CUDA, about a minute each.
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False,
                                 cache_implementation="static", disable_compile=True,
                                 eos_token_id=None, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - start, out

    generate(2)  # warm-up: the static cache, the kernels
    t_one, _ = generate(1)
    t_all, out = generate(args.new_tokens)
    steps = args.new_tokens - 1
    decode_s = max(t_all - t_one, 1e-9)
    return dict(decode_steps=steps, decode_tokens=steps * len(prompts),
                tokens_per_s=steps * len(prompts) / decode_s, step_ms_median=1e3 * decode_s / steps,
                step_ms_p90=None, wall_s=t_all + t_one,
                outputs=out[:, ids.shape[1]:].tolist())


def _quantile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _versions() -> dict:
    import transformers

    versions = dict(python=platform.python_version(), torch=torch.__version__,
                    transformers=transformers.__version__)
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    revision = os.environ.get("DYNCTX_GIT_REVISION")
    if not revision:
        try:
            revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                      text=True, cwd=Path(__file__).parent, timeout=5
                                      ).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            revision = None
    versions["git_revision"] = revision
    return versions


def _table(data: dict) -> str:
    lines = [f"device {data['device']}  dtype {data['dtype']}  "
             f"params {(data['params'] or 0) / 1e9:.2f}B  "
             f"prompt {data['prompt_len']}  new tokens {data['new_tokens']}",
             f"{'mode':<12} {'batch':>5} {'tok/s':>10} {'step ms':>8} {'p90 ms':>8} "
             f"{'steps':>6} {'graph%':>6} {'same':>5}"]
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for run in data["runs"]:
        if "error" in run:
            lines.append(f"{run['mode']:<12} {run['batch']:>5}  ERROR {run['error'][:60]}")
            continue
        share = None
        if run.get("steps"):
            share = 100 * run["graph_shape_steps"] / run["steps"]
        lines.append(f"{run['mode']:<12} {run['batch']:>5} {fmt(run['tokens_per_s'], '.0f'):>10} "
                     f"{fmt(run['step_ms_median'], '.2f'):>8} {fmt(run['step_ms_p90'], '.2f'):>8} "
                     f"{run['decode_steps']:>6} {fmt(share, '.0f'):>6} "
                     f"{fmt(run.get('same_tokens_as_eager'), '.2f'):>5}")
    for note in data["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def run_order(batches: List[int], modes: List[str]) -> List[tuple]:
    """``(batch, mode)`` in the order they run: the engine modes batch by batch, then ``hf`` for
    every batch (a run cut short keeps the engine's numbers)."""
    engine_modes = [m for m in modes if m != "hf"]
    order = [(batch, mode) for batch in batches for mode in engine_modes]
    return order + [(batch, "hf") for batch in batches if "hf" in modes]


def write_json(path: Path, data: dict) -> None:
    """Replace ``path`` whole (write a temporary file, then rename): a process killed mid-write
    leaves the previous complete file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available here (use --tiny --device cpu "
              "to check the script on a CPU)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    data = dict(device=name or device.type, gpu=name if device.type == "cuda" else None,
                dtype=str(args.dtype).replace("torch.", ""), params=None,
                model=dict(MODEL_TINY if args.tiny else MODEL_1B),
                prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                warmup_tokens=args.warmup_tokens, batches=args.batches,
                num_cuda_graphs=args.num_cuda_graphs, versions=_versions(), runs=[],
                notes=["engine modes time pure decode steps only; hf: (t(N) - t(1)) / (N - 1)",
                       "graph%: steps the context ran in a CUDA graph shape; see graph_info for "
                       "whether the engine captured and replayed"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        write_json(out, data)
        if args.table_file:
            Path(args.table_file).write_text(_table(data) + "\n")

    save()
    model = build_model(args, device)
    data["params"] = sum(p.numel() for p in model.parameters())
    save()
    prompts = {batch: make_prompts(batch, args.prompt_len, model.config.vocab_size, args.seed)
               for batch in args.batches}
    eager_outputs: Dict[int, list] = {}
    for batch, mode in run_order(args.batches, args.modes):
        if time.perf_counter() - started > args.max_seconds:
            data["notes"].append(f"stopped before batch {batch} mode {mode}: --max-seconds "
                                 f"{args.max_seconds:g} spent")
            break
        run = dict(mode=mode, batch=batch)
        try:
            if mode == "hf":
                numbers = run_hf(model, prompts[batch], args, device)
            else:
                numbers = run_engine(model, prompts[batch], args, device,
                                     num_cuda_graphs=args.num_cuda_graphs
                                     if mode != "eager" else None,
                                     async_scheduling=mode == "graphs_async")
            run.update(numbers)
            outputs = run.pop("outputs")
            if mode == "eager":
                eager_outputs[batch] = outputs
            elif batch in eager_outputs:
                same = sum(a == b for a, b in zip(outputs, eager_outputs[batch]))
                run["same_tokens_as_eager"] = same / len(outputs)
        except Exception as exc:  # keep the other runs' results
            run["error"] = f"{type(exc).__name__}: {exc}"
        data["runs"].append(run)
        save()
        print(_table(data).splitlines()[-1 - len(data["notes"])], flush=True)
    data["total_s"] = time.perf_counter() - started
    save()
    print(_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
