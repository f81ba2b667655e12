"""Bad input to the generic transformers path: a model whose attention does not go through
transformers' seam, a window below 1, options it cannot honour. Each error names the model and
what it lacks, and is raised before an engine exists."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from generic_families import tiny_family

from dynctx.engine import Engine
from dynctx.models import GenericAdapter
from dynctx.models.generic import DynctxCache, seam_problems

SMALL = dict(block_size_tokens=8, buffer_size_gb=0.001, max_tokens=16)


def qwen3_next():
    config = T.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["linear_attention", "full_attention"], num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8)
    return T.Qwen3NextForCausalLM(config).eval()


def mamba():
    return T.MambaForCausalLM(T.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                            state_size=4)).eval()


def gemma2():
    return T.Gemma2ForCausalLM(T.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()


def bert():
    return T.BertForMaskedLM(T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=32)).eval()


@pytest.mark.parametrize("build, lacks", [
    (qwen3_next, ["_supports_attention_backend", "linear_attention"]),
    (mamba, ["_supports_attention_backend", "no attention module"]),
    (gemma2, ["attn_logit_softcapping=50.0"]),
    (bert, ["logits_to_keep", "bidirectionally"]),
], ids=["qwen3_next", "mamba", "gemma2", "bert"])
def test_a_model_off_the_seam_is_refused_naming_what_it_lacks(build, lacks):
    model = build()
    name = type(model).__name__
    with pytest.raises(NotImplementedError, match=name) as error:
        Engine.from_transformers(model, **SMALL)
    for piece in lacks:
        assert piece in str(error.value)
    assert seam_problems(model)


@pytest.mark.parametrize("window", [0, -2])
def test_a_window_below_one_is_refused_naming_the_layer(window):
    model = tiny_family("gemma3")
    model.model.layers[0].self_attn.sliding_window = window
    with pytest.raises(ValueError, match=rf"Gemma3ForCausalLM layer 0: sliding_window={window}"):
        Engine.from_transformers(model, **SMALL)


def test_a_window_below_one_at_run_time_is_refused():
    """A window that reaches the attention function only at run time is checked there too."""
    model = tiny_family("mistral")
    engine = Engine.from_transformers(model, **SMALL)
    model.config.sliding_window = 0  # Mistral passes its config's window on every call
    with pytest.raises(ValueError, match="MistralForCausalLM layer 0: sliding_window=0"):
        engine.generate([[5, 6, 7]], max_new_tokens=2)


def test_explicit_backends_without_windows_are_refused():
    model = tiny_family("gpt_oss")
    with pytest.raises(NotImplementedError, match="GptOssForCausalLM has sliding windows "
                                                  r"\(layers \[0\]\) and attention sinks"):
        GenericAdapter.from_transformers(model, attention_backend="flash_attn")
    assert GenericAdapter.from_transformers(model).attention_backend_request == "torch"


def test_options_the_generic_path_cannot_honour():
    model = tiny_family("qwen2")
    with pytest.raises(ValueError, match="rope='cos_sin': Qwen2ForCausalLM takes the generic"):
        Engine.from_transformers(model, rope="cos_sin", **SMALL)
    with pytest.raises(ValueError, match="dtype=torch.bfloat16: Qwen2ForCausalLM runs its own"):
        Engine.from_transformers(model, params_dtype=torch.bfloat16, **SMALL)
    with pytest.raises(ValueError, match="fused_rope_kv_append"):
        Engine.from_transformers(model, fused_rope_kv_append=True, **SMALL)
    model.train()
    with pytest.raises(ValueError, match="training mode: call model.eval"):
        Engine.from_transformers(model, **SMALL)


def test_a_model_that_bypasses_the_seam_raises_instead_of_wrong_tokens(monkeypatch):
    """A layer whose attention never reaches the seam (here: a module that computes its output
    itself) makes the forward raise, naming the layers."""
    model = tiny_family("qwen2")
    engine = Engine.from_transformers(model, **SMALL)

    def own_attention(hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None

    monkeypatch.setattr(model.model.layers[1].self_attn, "forward", own_attention)
    with pytest.raises(RuntimeError, match=r"Qwen2ForCausalLM: layers \[1\] did not go through"):
        engine.generate([[5, 6, 7]], max_new_tokens=2)
    assert model.config._attn_implementation != "dynctx_paged"


def test_the_cache_has_no_sequence_length():
    model = tiny_family("qwen2")
    adapter = GenericAdapter.from_transformers(model)

    class Step:
        pass

    step = Step()
    step.adapter = adapter
    with pytest.raises(NotImplementedError, match="Qwen2ForCausalLM asks its cache for a seq"):
        DynctxCache(step).get_seq_length()
