"""Differential fuzz of prefix caching (docs/SEMANTICS.md §17): caching on against caching off.

Each seed draws a workload of prompts cut from three token families (so that they share
prefixes, are prefixes of one another, repeat whole, or fall short of a block), random suffixes,
generation lengths, arrival steps, salts, a termination id and requests asking for log probs,
and an engine (block size 4, 8 or 16; 8 to 64 tokens per step, so that prompts are chunked;
a KV buffer small enough that requests pause and get evicted; an eviction policy; on the Llama,
the CUDA-graph stand-in runner half the time; on the NemotronH hybrid, a Mamba snapshot budget of
0, 1, 2 or 16 snapshots). The run with caching must give every request the same tokens as the
run without; a difference or an exception is reported with the seed and the engine's arguments.
The exit status is 1 when any seed failed.

    python -P tests/e2e/prefix_caching_fuzz.py --seeds 0 200 --models llama nemotron_h deepseek

A test driver, not a benchmark: it lives beside the end-to-end helpers it builds its engines
with (and puts this folder and ``tests/``, not the checkout, on ``sys.path``).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):  # tests/ (triton_marks), then tests/e2e/ first
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

MODELS = ("llama", "nemotron_h", "deepseek")


def _model(name: str):
    """``(transformers model, build_engine, bytes of one Mamba snapshot or 0)``."""
    if name == "llama":
        from e2e_helpers import build_engine, tiny_llama
        return tiny_llama(seed=5, max_positions=128, hidden=32, intermediate=64), build_engine, 0
    if name == "nemotron_h":
        from test_nemotron_h import build_engine, tiny_nemotron_h
        hf = tiny_nemotron_h(seed=3, max_positions=128)
        probe = build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=32,
                             kernel_backend="torch", attention_backend="torch", cuda_graphs=False)
        return hf, build_engine, probe.context.mamba_bytes_per_request
    from test_deepseek_mla import build_engine, tiny_deepseek
    return tiny_deepseek(seed=2, max_positions=128), build_engine, 0


def one_seed(seed: int, name: str, hf, build, snapshot_bytes: int) -> tuple:
    """Run seed ``seed`` with caching off and on: ``(problem, hits)``, the problem '' when
    the runs agree, the hits of the run with caching."""
    from e2e_helpers import greedy_requests, make_prompts

    rng = random.Random(seed)
    vocab = hf.config.vocab_size
    families = [make_prompts([rng.randint(4, 48)], vocab, seed=seed * 10 + k)[0]
                for k in range(rng.randint(1, 3))]
    prompts = []
    for i in range(rng.randint(4, 12)):
        base = rng.choice(families)
        cut = rng.randint(1, len(base)) if rng.random() < 0.4 else len(base)
        tail = make_prompts([rng.randint(0, 12)], vocab, seed=seed * 100 + i)[0] \
            if rng.random() < 0.7 else []
        prompts.append((base[:cut] + tail)[:100])
    gens = [rng.randint(1, 10) for _ in prompts]
    arrivals = list(itertools.accumulate(rng.choice([0, 1, 2, 4]) for _ in prompts))
    salts = [rng.choice([None, None, "a", 7, b"a"]) for _ in prompts]
    log_probs = [(rng.random() < 0.2, rng.random() < 0.5) for _ in prompts]
    termination = rng.choice([None, rng.randrange(vocab)])
    bs = rng.choice([4, 8, 16])
    kwargs = dict(block_size=bs, blocks=rng.randint(128 // bs // 2 + 2, 40),
                  paused_blocks=rng.randint(1, 4), max_tokens=rng.choice([8, 16, 32, 64]),
                  kernel_backend="torch", cuda_graphs=name == "llama" and rng.random() < 0.5,
                  num_cuda_graphs=4, prefix_caching_eviction_policy=rng.choice(["lru",
                                                                                "ref_zero"]))
    if name == "nemotron_h":
        kwargs.update(attention_backend="torch",
                      prefix_caching_mamba_gb=rng.choice([0, 1, 2, 16, 16]) * snapshot_bytes
                      / 1024 ** 3)
    outputs, hits = [], 0
    for enable in (False, True):
        engine = build(hf, enable_prefix_caching=enable, **kwargs)
        requests = greedy_requests(prompts, gens, termination_id=termination)
        for request, salt, (wants, skip_prompt) in zip(requests, salts, log_probs):
            request.prefix_caching_salt = salt
            request.sampling_params.return_log_probs = wants
            request.sampling_params.skip_prompt_log_probs = skip_prompt
        results = engine.generate_requests(requests, arrival_steps=arrivals)
        outputs.append([(r.generated_tokens, r.finish_reason) for r in results])
        hits = engine.stats.prefix_cache.get("prefix_cache_hits", 0)
    differ = [i for i, (off, on) in enumerate(zip(*outputs)) if off != on]
    if differ:
        return f"requests {differ} differ ({kwargs})", hits
    return "", hits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs=2, default=(0, 50), metavar=("FIRST", "END"),
                        help="seeds [FIRST, END) per model (default 0 50)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    # The hybrid runs without a snapshot budget warn at construction, as they should.
    logging.getLogger("dynctx.context").setLevel(logging.ERROR)
    failures, runs, start = 0, 0, time.perf_counter()
    for name in args.models:
        hf, build, snapshot_bytes = _model(name)
        hits = hit_runs = 0
        for seed in range(*args.seeds):
            runs += 1
            try:
                problem, seed_hits = one_seed(seed, name, hf, build, snapshot_bytes)
            except Exception:  # noqa: BLE001 - reported with its seed
                problem, seed_hits = traceback.format_exc(), 0
            hits, hit_runs = hits + seed_hits, hit_runs + (seed_hits > 0)
            if problem:
                failures += 1
                print(f"{name} seed {seed}: {problem}", flush=True)
        # A fuzz whose workloads never hit would test nothing: the hits are reported.
        print(f"{name}: {hit_runs} of {len(range(*args.seeds))} seeds hit the cache, "
              f"{hits} hits in all", flush=True)
    print(f"{runs} runs, {failures} failures, {time.perf_counter() - start:.1f} s wall")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
