"""The two modes of the Megatron-Core 0.19 port, and the names its test files import.

The ported files (``test_mcore019_*.py``) are Megatron-LM's own unit tests at tag
``core_v0.19.0``. Megatron's files import their classes from ``megatron.core``; the port imports
them from here, and what they are depends on the process's mode, chosen once, before anything
imports ``megatron``:

* **megatron019** (``DYNCTX_MEGATRON019_SRC`` names an extracted 0.19 source tree, the folder
  that holds ``megatron/``): importing this module puts that tree first on ``sys.path``, so
  ``megatron`` is 0.19's package, not the installed megatron-core 0.16.1, and these names are
  0.19's own classes. Each test runs inside ``megatron019_on_cpu()`` (``mcore019_shim.py``).
  This mode shows that the port is faithful: ``run_port.py`` runs it.
* **dynctx** (the variable unset): the names are dynctx's, where dynctx has them, and a
  ``Gap`` where it does not yet: a placeholder that raises ``DynctxGap`` naming the missing
  0.19 name and its 0.19 source location as soon as a test uses it (``GAPS``). The installed
  megatron-core 0.16.1 supplies ``TransformerConfig``, ``parallel_state``,
  ``get_num_layers_to_build`` and ``Symbols``, which is what a dynctx user passes.

The names that are the same module in both modes (``TransformerConfig``, ``parallel_state``,
``get_num_layers_to_build``) the test files import from ``megatron.core`` directly, as
Megatron's do.

``Utils`` and ``run_ranks`` are the 0.16.1 port's (``tests/megatron/mcore_port.py``): one
process with only ``parallel_state``'s world sizes set, or forked CPU ranks over gloo with the
real ``initialize_model_parallel`` (both 0.16.1's and 0.19's ``parallel_state`` take it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict

_HERE = Path(__file__).resolve().parent
_MEGATRON016_PORT = _HERE.parent / "megatron"
if str(_MEGATRON016_PORT) not in sys.path:
    sys.path.insert(0, str(_MEGATRON016_PORT))

from mcore_port import Utils, run_ranks  # noqa: E402

__all__ = [
    "DEVICE", "MODE", "SOURCE_ENV", "GAPS", "DynctxGap", "Gap", "Utils", "run_ranks",
    "source_tree", "held", "context_class",
]

SOURCE_ENV = "DYNCTX_MEGATRON019_SRC"
MODES = ("megatron019", "dynctx")
MODE = "megatron019" if os.environ.get(SOURCE_ENV) else "dynctx"

#: Where the ported tests put their tensors (Megatron's files say ``'cuda'`` or
#: ``torch.cuda.current_device()``).
DEVICE = "cpu"


def source_tree() -> Path:
    """The 0.19 source tree of megatron019 mode, checked: it holds ``megatron/core`` at 0.19."""
    root = Path(os.environ[SOURCE_ENV]).expanduser().resolve()
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise FileNotFoundError(
            f"{SOURCE_ENV}={root} must be the folder that holds megatron/core (an extracted "
            f"Megatron-LM core_v0.19.0 tree); {info} does not exist")
    text = info.read_text()
    if "MAJOR = 0" not in text or "MINOR = 19" not in text:
        raise ValueError(f"{info} is not Megatron-Core 0.19.x")
    return root


def _activate_source_tree() -> None:
    """Put the 0.19 tree first on ``sys.path``; refuse if another ``megatron`` came first."""
    tree = source_tree()
    loaded = sys.modules.get("megatron")
    if loaded is not None and Path(list(loaded.__path__)[0]).resolve() != tree / "megatron":
        raise ImportError(
            f"{SOURCE_ENV} is set but `megatron` was imported from {list(loaded.__path__)[0]} "
            f"first: run tests/megatron019 in a pytest process of its own (run_port.py does)")
    if str(tree) not in sys.path:
        sys.path.insert(0, str(tree))
    os.environ.setdefault("NO_VCS_VERSION", "1")  # 0.19's package_info runs git otherwise


class DynctxGap(NotImplementedError):
    """A ported test used a Megatron-Core 0.19 name that dynctx does not have yet."""


class Gap:
    """Stands for a 0.19 name dynctx lacks; any use raises ``DynctxGap`` naming it."""

    def __init__(self, name: str, where: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_where", where)

    def _raise(self, *args: Any, **kwargs: Any):
        raise DynctxGap(f"dynctx has no {self._name} yet (Megatron-Core 0.19: {self._where}); "
                        f"see the gap list in tests/megatron019/README.md")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._raise()

    __call__ = __mul__ = __rmul__ = __index__ = __int__ = __iter__ = _raise

    def __repr__(self) -> str:
        return f"Gap({self._name!r})"


#: 0.19 names the ported files import that dynctx lacks -> their 0.19 source location.
GAPS: Dict[str, str] = {}


#: The names the ported files import -> the 0.19 module that defines them.
MEGATRON019_MODULES: Dict[str, str] = {
    "AsyncScheduleMode": "megatron.core.inference.config",
    "CudaGraphSizingDistribution": "megatron.core.inference.config",
    "InferenceConfig": "megatron.core.inference.config",
    "KVCacheManagementMode": "megatron.core.inference.config",
    "MambaInferenceStateConfig": "megatron.core.inference.config",
    "PrefixCachingCoordinatorPolicy": "megatron.core.inference.config",
    "PrefixCachingEvictionPolicy": "megatron.core.inference.config",
    "DynamicInferenceContext": "megatron.core.inference.contexts.dynamic_context",
    "RequestOverflowError": "megatron.core.inference.contexts.dynamic_context",
    "TokenOverflowError": "megatron.core.inference.contexts.dynamic_context",
    "ContextGPUView": "megatron.core.inference.contexts.gpu_view",
    "KVBlockAllocator": "megatron.core.inference.contexts.kv_block_allocator",
    "MAX_INTERMEDIATE_OFFSETS_PER_REQUEST": "megatron.core.inference.contexts.mamba_slot_allocator",
    "DynamicInferenceRequest": "megatron.core.inference.inference_request",
    "compute_block_hashes_batched": "megatron.core.inference.inference_request",
    "TorchSampling": "megatron.core.inference.sampling.torch_sampling",
    "SamplingParams": "megatron.core.inference.sampling_params",
    "Symbols": "megatron.core.models.hybrid.hybrid_layer_allocation",
}


def _megatron019_names() -> Dict[str, Any]:
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # missing Transformer Engine / Apex
        return {name: getattr(importlib.import_module(module), name)
                for name, module in MEGATRON019_MODULES.items()}


def _dynctx_names() -> Dict[str, Any]:
    import dynctx.context as dc

    names: Dict[str, Any] = {
        name: getattr(dc, name) for name in (
            "InferenceConfig", "MambaInferenceStateConfig", "PrefixCachingEvictionPolicy",
            "AsyncScheduleMode", "CudaGraphSizingDistribution", "KVCacheManagementMode",
            "PrefixCachingCoordinatorPolicy",
            "DynamicInferenceContext", "RequestOverflowError", "TokenOverflowError",
            "DynamicInferenceRequest", "compute_block_hashes_batched", "SamplingParams",
            "MAX_INTERMEDIATE_OFFSETS_PER_REQUEST", "ContextGPUView", "KVBlockAllocator",
            "TorchSampling",
        )
    }
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # missing Transformer Engine / Apex
            # megatron-core 0.16.1 keeps the layer symbols here (0.19: models/hybrid).
            from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols
    except ImportError:  # without megatron-core the ported files are skipped at import
        Symbols = Gap("Symbols", "megatron/core/models/hybrid/hybrid_layer_allocation.py")
    names["Symbols"] = Symbols
    for name, where in GAPS.items():
        names[name] = getattr(dc, name, None) or Gap(name, where)
    return names


if MODE == "megatron019":
    _activate_source_tree()
    _NAMES = _megatron019_names()
else:
    _NAMES = _dynctx_names()
globals().update(_NAMES)
__all__ += sorted(_NAMES)


def context_class() -> type:
    """The mode's ``DynamicInferenceContext`` class (whose rounders the tests change)."""
    return _NAMES["DynamicInferenceContext"]


def held():
    """What one test of this mode runs inside: the CPU shim for 0.19, nothing for dynctx."""
    import contextlib

    if MODE == "megatron019":
        from mcore019_shim import megatron019_on_cpu

        return megatron019_on_cpu()
    return contextlib.nullcontext()
