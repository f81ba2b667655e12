"""Construction from ``transformers`` (``engine/build.py``): the context's sizes are computed, not
found by trying a context and reading its error."""

from __future__ import annotations

import warnings

import pytest
from e2e_helpers import gib_for_blocks, tiny_llama
from test_deepseek_mla import tiny_deepseek
from test_nemotron_h import tiny_nemotron_h

from dynctx.context import DynamicInferenceContext
from dynctx.engine import Engine
from dynctx.engine.build import derived_max_requests, request_rows

MODELS = {"llama": tiny_llama, "deepseek-mla": lambda: tiny_deepseek(moe=False),
          "nemotron-h": tiny_nemotron_h}


def context_kwargs(engine: Engine) -> dict:
    """The arguments the engine's context was built with, ``max_requests`` left out."""
    ctx = engine.context
    kwargs = dict(params_dtype=ctx.params_dtype, num_layers=ctx.num_layers,
                  kv_channels=ctx.kv_channels, num_attention_heads=ctx.num_attention_heads,
                  max_sequence_length=ctx.max_sequence_length, buffer_size_gb=ctx.buffer_size_gb,
                  paused_buffer_size_gb=ctx.paused_buffer_size_gb,
                  block_size_tokens=ctx.block_size_tokens, device=ctx.device,
                  unified_memory_level=0, kernel_backend="torch")
    for name in ("cache_mla_latent", "kv_lora_rank", "qk_pos_emb_head_dim"):
        kwargs[name] = getattr(ctx, name)
    mamba = getattr(engine.model, "mamba_inference_state_config", None)
    if mamba is not None:
        kwargs["mamba_inference_state_config"] = mamba
    return kwargs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_derived_max_requests_is_the_contexts_own(name):
    """``derived_max_requests`` computes what the context derives (one request per block,
    rounded), for an MHA, an MLA latent and a hybrid Mamba cache."""
    engine = Engine.from_transformers(MODELS[name](), block_size_tokens=16, max_tokens=4096,
                                      max_sequence_length=64, unified_memory_level=0,
                                      buffer_size_gb=gib_for_blocks(tiny_llama(), 16, 40),
                                      kernel_backend="torch")
    kwargs = context_kwargs(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = DynamicInferenceContext(**kwargs)
    assert derived_max_requests(kwargs, tp=1) == built.max_requests == engine.context.max_requests


def test_max_requests_is_capped_at_max_tokens_when_derived_larger():
    """One GiB of blocks derives far more request rows than a 64-token step can run: the engine
    caps ``max_requests`` at ``max_tokens`` (rounded to the request rounder); an explicit
    ``max_requests`` and a derived count that fits are left to the context."""
    hf = tiny_llama()
    engine = Engine.from_transformers(hf, block_size_tokens=16, max_tokens=64,
                                      max_sequence_length=64, kernel_backend="torch")
    kwargs = context_kwargs(engine)
    assert derived_max_requests(kwargs, tp=1) > 64
    assert engine.context.max_requests == 64 == request_rows(dict(kwargs, max_tokens=64), 1)
    rounder = DynamicInferenceContext.REQUEST_ROUNDER
    assert request_rows(dict(kwargs, max_tokens=70), 1) == 70 - 70 % rounder
    assert request_rows(dict(kwargs, max_tokens=64, max_requests=8), 1) == 8
    assert request_rows(dict(kwargs, max_tokens=2 ** 30), 1) is None
    # Arguments that do not size leave the error to the context.
    assert derived_max_requests(dict(kwargs, buffer_size_gb="big"), tp=1) is None
