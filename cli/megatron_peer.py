"""Megatron-Core 0.16.1's own Triton KV-append kernel, as a peer for ``kv_append`` on a GPU.

``python -m dynctx autotune bench`` and ``bench/test_kernels_bench.py`` time it on the very
buffers of a ``kv_append`` tune case. Megatron-Core ships it as
``megatron/core/inference/contexts/fused_kv_append_kernel.py``
(``triton_append_key_value_cache``). That file imports only ``triton`` and ``torch``, so it is
loaded by itself, without executing ``megatron/core/__init__.py`` and its dependencies, from the
first of:

1. the file named by ``$DYNCTX_MEGATRON_KV_APPEND``;
2. an installed ``megatron-core`` (found with ``importlib.util.find_spec``, nothing imported);
3. a ``megatron_core-*.whl`` in ``$DYNCTX_MEGATRON_WHEEL_DIR`` (read out of the zip: the GPU
   machine has no registry, and the 2.5 MB wheel can be carried).

Its contract (read from that file): ``triton_append_key_value_cache(layer_number, key, value,
memory_buffer, padded_active_token_count, token_to_block_idx,
token_to_local_position_within_kv_block)`` with ``key``/``value`` ``[n, 1, H, D]``,
``memory_buffer`` ``[2, L, blocks, block_size, H, D]`` indexed as ``memory_buffer[0/1,
layer_number]``, and one program per (token, head). CUDA tensors only.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

KERNEL_PATH = "megatron/core/inference/contexts/fused_kv_append_kernel.py"
FILE_ENV = "DYNCTX_MEGATRON_KV_APPEND"
WHEEL_DIR_ENV = "DYNCTX_MEGATRON_WHEEL_DIR"
_CACHE: dict[str, tuple[ModuleType | None, str]] = {}


def _load_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("_megatron_fused_kv_append_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _named_path() -> Path | None:
    value = os.environ.get(FILE_ENV)
    return Path(value) if value else None


def _installed_path() -> Path | None:
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder).parent / KERNEL_PATH
        if candidate.is_file():
            return candidate
    return None


def _wheel_path() -> Path | None:
    folder = os.environ.get(WHEEL_DIR_ENV)
    if not folder:
        return None
    for wheel in sorted(glob.glob(os.path.join(folder, "megatron_core-*.whl"))):
        with zipfile.ZipFile(wheel) as archive:
            if KERNEL_PATH not in archive.namelist():
                continue
            target = Path(tempfile.mkdtemp(prefix="dynctx_megatron_")) / "fused_kv_append_kernel.py"
            target.write_bytes(archive.read(KERNEL_PATH))
            return target
    return None


def load() -> tuple[ModuleType | None, str]:
    """``(module, where it came from)``, or ``(None, why not)``."""
    if "module" in _CACHE:
        return _CACHE["module"]
    sources = [(f"${FILE_ENV}", _named_path), ("installed megatron-core", _installed_path),
               (f"wheel in ${WHEEL_DIR_ENV}", _wheel_path)]
    result: tuple[ModuleType | None, str] = (
        None, f"megatron-core is not installed, and neither ${FILE_ENV} nor ${WHEEL_DIR_ENV} "
              "names a carried copy")
    for label, find in sources:
        path = find()
        if path is None or not Path(path).is_file():
            continue
        try:
            module = _load_file(Path(path))
        except Exception as exc:  # a triton too old or too new for that file, say
            result = (None, f"{label} {path}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(module, "triton_append_key_value_cache"):
            result = (module, f"{label} {path}")
            break
        result = (None, f"{label} {path} has no triton_append_key_value_cache")
    _CACHE["module"] = result
    return result


def runner(buffer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_ids: torch.Tensor,
           slots: torch.Tensor) -> tuple[Callable[[], None] | None, str]:
    """A no-argument callable appending ``key``/``value`` ``[n, H, D]`` into layer 0 of
    ``buffer`` ``[2, L, blocks, block_size, H, D]`` with Megatron-Core's kernel."""
    module, where = load()
    if module is None:
        return None, where
    if buffer.device.type != "cuda":
        return None, "Megatron-Core's kernel runs on CUDA tensors only"
    n = block_ids.numel()
    key4, value4 = key[:n].unsqueeze(1), value[:n].unsqueeze(1)
    block_ids, slots = block_ids.contiguous(), slots.contiguous()

    def run() -> None:
        module.triton_append_key_value_cache(0, key4, value4, buffer, n, block_ids, slots)

    return run, where


def runner_from_case(case) -> tuple[Callable[[], None] | None, str]:
    """The Megatron-Core peer on the very buffers of a ``kv_append`` tune case."""
    needed = ("buffer", "key", "value", "block_ids", "slots")
    missing = [name for name in needed if not hasattr(case, name)]
    if missing:
        return None, f"the kv_append case has no {missing}"
    return runner(case.buffer, case.key, case.value, case.block_ids, case.slots)


def check_against_ours(case, config) -> None:
    """Raise ``AssertionError`` unless Megatron-Core's kernel writes what ours writes."""
    run, where = runner_from_case(case)
    if run is None:
        raise RuntimeError(where)
    case.buffer.copy_(case.initial)
    run()
    theirs = case.buffer.clone()
    case.buffer.copy_(case.initial)
    case.run(config)
    assert torch.equal(theirs.view(torch.uint8), case.buffer.view(torch.uint8)), \
        "Megatron-Core's kv append differs from ours"
