"""Shared helpers of the end-to-end tests: a tiny random Llama, sizes in blocks, an engine sized
in blocks, transformers references (greedy generate, last-token logits of a prefix) and the
checks every model's tests make against them."""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Optional, Sequence

import pytest
import torch
from sizing_warning import built
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine

hf_logging.set_verbosity_error()

FP32_LOGITS_ATOL = 1e-4
# bf16 against a bf16 transformers run: |ours - theirs| <= BF16_ATOL + BF16_RTOL * |theirs|
# elementwise. The two runs round differently (our fp32 rope and attention math, their bf16
# cos/sin and sdpa); we measured at most ~5e-3 on logits of magnitude ~0.5 (about 2 bf16 ulps),
# so this is a 4x margin.
BF16_ATOL, BF16_RTOL = 2e-2, 2e-2


def tiny_llama(*, seed: int = 0, vocab: int = 256, hidden: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
               max_positions: int = 256, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions)
    return LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)


# The CUDA cases carry the ``gpu`` marker (``pytest -m gpu`` on the GPU machine; the CPU run
# deselects them) and skip where no CUDA device is present.
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[
               pytest.mark.gpu,
               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


def block_bytes(hf: LlamaForCausalLM, block_size: int) -> int:
    config = hf.config
    head_dim = config.hidden_size // config.num_attention_heads
    itemsize = next(hf.parameters()).element_size()
    return (itemsize * 2 * config.num_hidden_layers * block_size * config.num_key_value_heads
            * head_dim)


def gib_for_blocks(hf, block_size: int, blocks: int,
                   block_bytes: Callable[..., int] = block_bytes) -> float:
    """``buffer_size_gb`` that gives exactly ``blocks`` blocks of ``block_bytes(hf,
    block_size)`` bytes (a Llama's K/V block by default)."""
    return blocks * block_bytes(hf, block_size) / 1024 ** 3


def build_engine(hf, *, block_size, blocks, paused_blocks, max_tokens, max_requests=None,
                 gib: Callable[..., float] = gib_for_blocks, **kwargs) -> Engine:
    """``Engine.from_transformers`` with ``blocks`` (``paused_blocks``) blocks of
    ``block_size`` tokens, ``gib(hf, block_size, blocks)`` converting blocks to GiB; the
    context's sizing warning asserted where small buffers provoke it (``sizing_warning``)."""
    return built(lambda: Engine.from_transformers(
        hf, block_size_tokens=block_size, buffer_size_gb=gib(hf, block_size, blocks),
        paused_buffer_size_gb=gib(hf, block_size, paused_blocks),
        max_tokens=max_tokens, max_requests=max_requests, **kwargs))


def pressure_workload(hf, case: dict, base_lengths: Sequence[int], base_gens: Sequence[int]):
    """``(prompts, greedy requests, arrival steps)`` of a pressure case: a one-token prompt, then
    ``base_lengths[1:]`` times ``case["scale"]``; two requests arrive per step."""
    scale = case["scale"]
    lengths = [1] + [n * scale for n in base_lengths[1:]]
    prompts = make_prompts(lengths, hf.config.vocab_size)
    requests = greedy_requests(prompts, base_gens)
    arrivals = [i // 2 for i in range(len(requests))]
    return prompts, requests, arrivals


def case_engine_sizes(case: dict) -> dict:
    """``build_engine`` sizes of a pressure case."""
    return dict(block_size=case["block_size"], blocks=case["blocks"],
                paused_blocks=case["paused_blocks"], max_tokens=case["max_tokens"],
                max_requests=case["max_requests"])


def refuse_torch_references(monkeypatch, references: Sequence[tuple]) -> None:
    """Make each ``(module, name)`` torch reference raise, so the Triton kernel must run."""
    for module, name in references:
        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran: the Triton kernel should have")
        monkeypatch.setattr(importlib.import_module(module), name, refuse)


def make_prompts(lengths: Sequence[int], vocab: int, seed: int = 1) -> List[List[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def greedy_requests(prompts: Sequence[Sequence[int]], gens: Sequence[int],
                    termination_id: Optional[int] = None) -> List[DynamicInferenceRequest]:
    return [DynamicInferenceRequest(
        request_id=i, prompt_tokens=list(prompt),
        sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=gen,
                                       termination_id=termination_id))
        for i, (prompt, gen) in enumerate(zip(prompts, gens))]


def hf_greedy(hf: LlamaForCausalLM, prompt: Sequence[int], max_new_tokens: int,
              eos: Optional[int] = None) -> List[int]:
    """transformers' greedy ``generate`` for one prompt alone."""
    device = next(hf.parameters()).device
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)], device=device),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos if eos is not None else 0)
    return out[0, len(prompt):].tolist()


class PrefixLogits:
    """transformers' last-token logits (fp32) of a full forward over a token prefix, cached."""

    def __init__(self, hf: LlamaForCausalLM):
        self.hf = hf
        self._cache: Dict[tuple, torch.Tensor] = {}

    def __call__(self, tokens: Sequence[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self._cache:
            with torch.no_grad():
                ids = torch.tensor([list(tokens)], device=next(self.hf.parameters()).device)
                self._cache[key] = self.hf(ids).logits[0, -1].float().cpu()
        return self._cache[key]


def step_logit_errors(hf: LlamaForCausalLM, results, reference: Optional[PrefixLogits] = None):
    """For every recorded step of every request, ``(request_id, prefix_length, ours, theirs)``
    with theirs = transformers' logits over the same prefix of prompt + generated tokens.
    Checks that every generated token has the step that produced it."""
    reference = reference or PrefixLogits(hf)
    rows = []
    for result in results:
        sequence = result.prompt_tokens + result.generated_tokens
        prefixes = {length for length, _ in result.step_logits}
        needed = {len(result.prompt_tokens) + k for k in range(len(result.generated_tokens))}
        assert needed <= prefixes, (f"request {result.request_id}: no logits recorded for "
                                    f"prefixes {sorted(needed - prefixes)}")
        for length, ours in result.step_logits:
            rows.append((result.request_id, length, ours.cpu(), reference(sequence[:length])))
    return rows


def worst_logit_error(hf, results, reference: Optional[PrefixLogits] = None) -> float:
    """The largest ``|ours - transformers|`` over every recorded step logit."""
    return max(float((ours.cpu() - theirs).abs().max())
               for _, _, ours, theirs in step_logit_errors(hf, results, reference))


def assert_pressure_stats(stats, results) -> None:
    """The workload paused, evicted and chunked requests."""
    assert stats.pauses > 0, "the workload should pause requests"
    assert stats.evictions > 0, "the workload should evict paused requests"
    assert stats.chunked_prefills > 0 and stats.prefill_chunks > stats.chunked_prefills
    assert any(r.num_evictions for r in results) and any(r.num_prefill_chunks for r in results)


def assert_requests_match_greedy(hf, requests, prompts, results) -> None:
    """Every request ran to its length and generated transformers' greedy tokens for its prompt
    alone."""
    for request, result in zip(requests, results):
        gen = request.sampling_params.num_tokens_to_generate
        assert result.finish_reason == "length"
        assert result.generated_tokens == hf_greedy(hf, prompts[request.request_id], gen), \
            f"request {request.request_id} (prompt {len(prompts[request.request_id])} tokens)"


def assert_matches_transformers(hf, prompts, gens, results,
                                reference: Optional[PrefixLogits] = None) -> None:
    """Greedy tokens equal transformers' ``generate`` per prompt, and every step's logits are
    within ``FP32_LOGITS_ATOL`` of transformers' full forward."""
    for prompt, gen, result in zip(prompts, gens, results):
        assert result.generated_tokens == hf_greedy(hf, prompt, gen)
    worst = worst_logit_error(hf, results, reference)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"
