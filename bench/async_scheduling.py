"""Steps per second of the engine with and without async scheduling, same workload, same run.

A tiny random Llama (vocab 256, hidden 64, 2 layers, 4 query / 2 KV heads) decodes
``--requests`` prompts of 4-32 tokens, ``--new-tokens`` each, greedy, EOS ignored, all
admitted at once; the two modes alternate ``--repeats`` times and each keeps its fastest run
(on a shared machine other work only ever adds time). Outputs are compared token for token.

On a CPU nothing runs concurrently: the copy to "pinned" memory and its event are plain calls,
and the forward finishes before the host goes on. So the CPU numbers are the host cost of async
scheduling's extra bookkeeping (the one-step-late reads, the retired rows, one more step at the
end), not an overlap; only a GPU run (``--device cuda``) can show what the overlap gains, and
none has been made yet (docs/DESIGN.md §11).

Usage::

    python -P bench/async_scheduling.py                       # 32 requests x 32 tokens
    python -P bench/async_scheduling.py --requests 64 --new-tokens 64 --repeats 3
    python -P bench/async_scheduling.py --device cuda --num-cuda-graphs 8   # on a GPU (unrun)
"""

from __future__ import annotations

import argparse
import time

import torch


def run_once(hf, prompts, new_tokens: int, *, async_scheduling: bool, device: str,
             num_cuda_graphs: int) -> tuple:
    from dynctx.engine import Engine

    on_cpu = not device.startswith("cuda")
    graphs = dict(num_cuda_graphs=num_cuda_graphs) if num_cuda_graphs else {}
    engine = Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=0.05,
                                      max_tokens=512, max_requests=len(prompts),
                                      kernel_backend="torch" if on_cpu else "auto",
                                      async_scheduling=async_scheduling, **graphs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    steps = engine.stats.forward_steps + engine.stats.idle_steps
    return elapsed, steps, outputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-cuda-graphs", type=int, default=0,
                        help="capture and replay the forward per graph batch dimension (on a "
                             "CPU the stand-in runner); 0: eager")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0 keeps torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    hf = LlamaForCausalLM(config).eval().to(args.device)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 33, (args.requests,), generator=generator).tolist()
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]

    best = {}
    outputs = {}
    for _ in range(args.repeats):
        for mode in (False, True):
            elapsed, steps, out = run_once(hf, prompts, args.new_tokens,
                                           async_scheduling=mode, device=args.device,
                                           num_cuda_graphs=args.num_cuda_graphs)
            outputs[mode] = out
            if mode not in best or elapsed < best[mode][0]:
                best[mode] = (elapsed, steps)
    same = outputs[False] == outputs[True]
    tokens = args.requests * args.new_tokens
    print(f"async scheduling bench: {args.requests} requests x {args.new_tokens} tokens, "
          f"{args.device}, {torch.get_num_threads()} thread(s), "
          f"{args.num_cuda_graphs or 'no'} CUDA graphs, best of {args.repeats}")
    print(f"{'mode':<8} {'steps':>6} {'time s':>8} {'steps/s':>9} {'tokens/s':>9}")
    for mode in (False, True):
        elapsed, steps = best[mode]
        print(f"{'async' if mode else 'sync':<8} {steps:>6} {elapsed:>8.3f} "
              f"{steps / elapsed:>9.1f} {tokens / elapsed:>9.0f}")
    ratio = best[False][0] / best[True][0]
    print(f"async / sync throughput: {ratio:.3f}x; outputs {'identical' if same else 'DIFFER'}")
    if not args.device.startswith("cuda"):
        print("(a CPU run: the host cost of the extra bookkeeping, not overlap)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
