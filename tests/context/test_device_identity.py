"""Device identity (issue 19 §1): every device the project stores is indexed, and devices are
compared through ``kernels.devices.same_device``.

``torch.device("cuda") != torch.device("cuda", 0)``: a context (or engine) that kept a bare
``"cuda"`` refused every tensor made on the GPU ("key is on cuda:0, the context on cuda"). On a
CPU a stand-in for ``torch.cuda`` (``is_available``, ``current_device``, ``device_count``) and a
tensor that reports ``cuda:0`` reach the comparisons.
"""

import pytest
import torch

from dynctx.context import construction, inputs
from dynctx.kernels.devices import indexed_device, same_device


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda`` as on a machine with two GPUs, device ``current[0]`` current."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    return current


class _OnCuda0(torch.Tensor):
    """A CPU tensor that reports ``cuda:0``, as every tensor made on the first GPU does."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def on_cuda0(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(_OnCuda0)


def test_stored_devices_are_indexed(fake_cuda):
    assert indexed_device("cuda") == torch.device("cuda", 0)
    assert indexed_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")
    # The context stores the resolved device (default and "cuda" alike) indexed.
    assert construction.resolve_device("cuda") == torch.device("cuda", 0)
    assert construction.resolve_device(None) == torch.device("cuda", 0)
    fake_cuda[0] = 1
    assert construction.resolve_device("cuda") == torch.device("cuda", 1)


def test_same_device_is_the_one_comparison(fake_cuda):
    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert cuda != cuda0  # torch's own comparison: the trap
    assert same_device(cuda, cuda0) and same_device(cuda0, "cuda")
    assert not same_device(cuda, cuda1) and not same_device(cuda0, "cpu")
    fake_cuda[0] = 1
    assert same_device(cuda, cuda1) and not same_device(cuda, cuda0)


def test_context_edge_checks_take_tensors_made_on_its_gpu(fake_cuda):
    """The checks a step's K/V, logits, tokens and mask meet, for a context resolved from a
    bare ``"cuda"``: a tensor on ``cuda:0`` is the context's, one on another GPU is not."""
    device = construction.resolve_device("cuda")
    key = on_cuda0(torch.zeros(4, 1, 2, 8))
    assert inputs.check_step_tensor("key", key, 4, device, torch.float32, (2, 8), "H, D") \
        .shape == (4, 2, 8)
    inputs.check_logits(on_cuda0(torch.zeros(1, 4, 11)), device, None)
    inputs.check_rope_call("query", on_cuda0(torch.zeros(4, 2, 8)), 4, device, "query_emb",
                           on_cuda0(torch.zeros(8, 1, 1, 8)), 3)
    assert inputs.check_new_tokens(on_cuda0(torch.zeros(3, dtype=torch.int64)), 3, device,
                                   validate=False, vocab_size=None).shape == (3,)
    fake_cuda[0] = 1  # the context on cuda:1 now: a cuda:0 tensor is refused, naming both
    other = construction.resolve_device("cuda")
    with pytest.raises(ValueError, match=r"key is on cuda:0, the context on cuda:1"):
        inputs.check_step_tensor("key", key, 4, other, torch.float32, (2, 8), "H, D")


def test_engine_from_transformers_stores_an_indexed_device(fake_cuda, monkeypatch):
    """``Engine.from_transformers(device="cuda")`` hands its adapter (and so its context) the
    indexed device."""
    import transformers

    from dynctx.engine import Engine, build

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    seen = []

    class Stop(Exception):
        pass

    def adapter(hf_model, *, device, **kwargs):
        seen.append(device)
        raise Stop

    monkeypatch.setattr(build, "transformers_adapters", lambda: {"LlamaForCausalLM": adapter})
    with pytest.raises(Stop):
        Engine.from_transformers(hf, device="cuda", buffer_size_gb=0.001)
    assert seen == [torch.device("cuda", 0)]
