"""Megatron-Core 0.16.1's ``DynamicInferenceContext`` on a CPU: shared by the differential
tests (``tests/megatron_oracle.py``) and ``bench/step_overhead.py``.

``megatron_on_cpu()`` is a re-entrant context manager that, while held, makes
``torch.cuda.current_device()`` return ``"cpu"`` and turns ``torch.cuda.nvtx.range_push`` /
``range_pop`` into no-ops (a CPU build of torch raises on both). Nothing is patched at import
time, and everything is restored on the last exit. ``make_megatron_context(**kwargs)`` returns a
``MegatronCPUContext``: a proxy that holds the patch around every method call of the wrapped
context. ``block_size_bytes`` and ``gb_for_blocks`` size a buffer in whole blocks.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict

import torch

_patch_lock = threading.RLock()
_patch_depth = 0
_saved: Dict[str, Any] = {}


def _cpu_current_device() -> str:
    return "cpu"


def _nvtx_noop(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def megatron_on_cpu():
    """Hold the CPU patches for Megatron-Core (re-entrant; restored on the outermost exit)."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            _saved["current_device"] = torch.cuda.current_device
            _saved["range_push"] = torch.cuda.nvtx.range_push
            _saved["range_pop"] = torch.cuda.nvtx.range_pop
            torch.cuda.current_device = _cpu_current_device
            torch.cuda.nvtx.range_push = _nvtx_noop
            torch.cuda.nvtx.range_pop = _nvtx_noop
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch.cuda.current_device = _saved.pop("current_device")
                torch.cuda.nvtx.range_push = _saved.pop("range_push")
                torch.cuda.nvtx.range_pop = _saved.pop("range_pop")


def patches_active() -> bool:
    """True while ``megatron_on_cpu`` is held (for tests of the patching itself)."""
    return _patch_depth > 0


def import_megatron():
    """Import megatron's context module (quietly: it warns about missing TE/Apex)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.inference import inference_request as mir
        from megatron.core.inference import sampling_params as msp
        from megatron.core.inference.contexts import dynamic_context as mdc
    return mdc, mir, msp


class MegatronCPUContext:
    """Proxy around a megatron ``DynamicInferenceContext`` that holds ``megatron_on_cpu()``
    during every method call. Attribute reads and writes go to the wrapped object; sub-objects
    (``block_allocator``, the metadata objects) are returned as they are, so call their methods
    that allocate (``block_allocator.reset()``) inside ``megatron_on_cpu()``.
    ``.raw`` is the wrapped context (for the benchmark, which holds the patch itself)."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        object.__setattr__(self, "raw", raw)

    def __getattr__(self, name):
        value = getattr(self.raw, name)
        if callable(value) and not isinstance(value, (torch.Tensor, type)) and hasattr(
            value, "__self__"
        ):

            def call(*args, **kwargs):
                with megatron_on_cpu():
                    return value(*args, **kwargs)

            call.__name__ = getattr(value, "__name__", name)
            return call
        return value

    def __setattr__(self, name, value):
        setattr(self.raw, name, value)

    def __repr__(self):
        return f"MegatronCPUContext({type(self.raw).__name__})"


CPU_DEFAULTS = dict(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    unified_memory_level=0,
)


def make_megatron_context(**kwargs) -> MegatronCPUContext:
    """Build megatron-core 0.16.1's ``DynamicInferenceContext`` on the CPU.

    Takes Megatron's keyword arguments; ``tensor_model_parallel_size=1``,
    ``pipeline_model_parallel_size=1`` and ``unified_memory_level=0`` are the defaults here (any
    other value is refused: none of them can run on a CPU). A ``device`` argument (our
    context's) is accepted and must be a CPU device. ``reset()`` is called after construction,
    as the engine does, so the "empty" tensors hold defined values.
    """
    mdc, _, _ = import_megatron()
    kwargs = dict(kwargs)
    device = kwargs.pop("device", None)
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"megatron runs on the CPU here; got device={device!r}")
    for key, value in CPU_DEFAULTS.items():
        kwargs.setdefault(key, value)
        if kwargs[key] != value:
            raise ValueError(f"{key}={kwargs[key]!r} cannot run on a CPU; use {value!r}")
    with megatron_on_cpu():
        raw = mdc.DynamicInferenceContext(**kwargs)
        raw.reset()
    return MegatronCPUContext(raw)


def make_request_factory(request_cls, sampling_params_cls, *, termination_id: int = -1):
    """A ``request_factory(request_id, prompt_tokens, num_tokens_to_generate)`` for the given
    request / sampling-params classes (Megatron's or ours; both take these keyword names)."""

    def factory(request_id: int, prompt_tokens: torch.Tensor, num_tokens_to_generate: int):
        return request_cls(
            request_id=int(request_id),
            prompt_tokens=prompt_tokens.clone(),
            sampling_params=sampling_params_cls(
                num_tokens_to_generate=int(num_tokens_to_generate),
                termination_id=termination_id,
            ),
        )

    return factory


def megatron_request_factory(request_id: int, prompt_tokens: torch.Tensor,
                             num_tokens_to_generate: int):
    """Megatron's ``DynamicInferenceRequest`` for the driver."""
    _, mir, msp = import_megatron()
    return make_request_factory(mir.DynamicInferenceRequest, msp.SamplingParams)(
        request_id, prompt_tokens, num_tokens_to_generate
    )


def block_size_bytes(*, params_dtype, num_layers, kv_channels, num_attention_heads,
                     block_size_tokens, **_ignored) -> int:
    """Bytes of one MHA KV block (docs/SEMANTICS.md §2.3), tp = 1."""
    return (
        params_dtype.itemsize * 2 * num_layers * block_size_tokens * num_attention_heads
        * kv_channels
    )


def gb_for_blocks(blocks: int, block_bytes: int) -> float:
    """A GiB figure that gives exactly ``blocks`` blocks (exact when block_bytes is 2^k)."""
    gb = blocks * block_bytes / 1024**3
    assert int(gb * 1024**3) // block_bytes == blocks, (blocks, block_bytes, gb)
    return gb
