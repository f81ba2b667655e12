"""``Engine.add_request`` cost against the number of requests already queued.

Requests are queued with future arrival steps, so nothing runs: the time is the checks at the
edge plus the scheduler's O(log n) arrival heap. Prints the best of ``--repeats`` batches of
``--batch`` adds after ``--queued`` requests each (a tiny random Llama, CPU, one thread).

    python bench/engine_add_request.py --queued 500 5500
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine


def make_request(rid: int) -> DynamicInferenceRequest:
    return DynamicInferenceRequest(
        request_id=rid, prompt_tokens=[1, 2, 3],
        sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=4))


def microseconds_per_add(hf, queued: int, batch: int, repeats: int) -> float:
    engine = Engine.from_transformers(hf, buffer_size_gb=0.001, block_size_tokens=16,
                                      max_tokens=32, max_sequence_length=64)
    for rid in range(queued):
        engine.add_request(make_request(rid), arrival_step=1000 + rid % 97)
    best, rid = float("inf"), queued
    for _ in range(repeats):
        requests = [make_request(rid + k) for k in range(batch)]
        rid += batch
        start = time.perf_counter()
        for request in requests:
            engine.add_request(request, arrival_step=1000 + request.request_id % 97)
        best = min(best, (time.perf_counter() - start) / batch)
    return best * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, nargs="+", default=[500, 5500])
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    hf = LlamaForCausalLM(config).eval()
    for queued in args.queued:
        cost = microseconds_per_add(hf, queued, args.batch, args.repeats)
        print(f"{queued:6d} queued: {cost:7.1f} us per add_request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
