"""Bounds checking for Triton's CPU interpreter.

Under ``TRITON_INTERPRET=1`` a ``tl.load``/``tl.store`` dereferences raw host addresses: an
out-of-bounds load reads whatever lies there and an out-of-bounds store silently corrupts the
process heap (it surfaces later, far away, as a crash in unrelated code). ``install()`` wraps the
interpreter so that every address a kernel touches (under its mask) must lie inside the storage
of one of the tensors passed to that launch; anything else raises ``InterpreterBoundsError``
naming the kernel, the access and the first offending address, at the access itself.
"""

from __future__ import annotations

import numpy as np

_installed = False


class InterpreterBoundsError(AssertionError):
    pass


def _tensor_ranges(values) -> list[tuple[int, int]]:
    ranges = []
    for value in values:
        if isinstance(value, (tuple, list)):
            ranges.extend(_tensor_ranges(value))
            continue
        base = getattr(value, "base", None) if type(value).__name__ == "TensorWrapper" else value
        if hasattr(base, "untyped_storage"):
            storage = base.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges


def install() -> None:
    """Wrap the interpreter's launch, load and store paths (idempotent)."""
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter

    launches: list[tuple[str, np.ndarray, np.ndarray]] = []
    original_init = interpreter.GridExecutor._init_args_hst
    original_call = interpreter.GridExecutor.__call__
    original_load = interpreter.InterpreterBuilder.create_masked_load
    original_store = interpreter.InterpreterBuilder.create_masked_store

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = original_init(self, args_dev, kwargs)
        ranges = sorted(_tensor_ranges(list(args_hst) + list(kwargs_hst.values())))
        starts = np.array([r[0] for r in ranges], dtype=np.uint64)
        ends = np.array([r[1] for r in ranges], dtype=np.uint64)
        launches.append((getattr(self.fn, "__name__", str(self.fn)), starts, ends))
        return args_hst, kwargs_hst

    def call(self, *args, **kwargs):
        depth = len(launches)
        try:
            return original_call(self, *args, **kwargs)
        finally:
            del launches[depth:]

    def check(kind: str, ptrs, mask) -> None:
        if not launches:
            return
        name, starts, ends = launches[-1]
        addresses = np.asarray(ptrs.data, dtype=np.uint64)
        selected = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
        addresses = addresses[selected]
        if addresses.size == 0:
            return
        size = np.uint64(np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize)
        # The storage that starts at or below each address must also contain its last byte.
        index = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
        inside = index >= 0
        inside[inside] &= addresses[inside] + size <= ends[index[inside]]
        if not inside.all():
            bad = int(addresses[~inside][0])
            raise InterpreterBoundsError(
                f"{name}: {kind} of {int((~inside).sum())} element(s) outside every tensor "
                f"argument's storage (first at address {bad:#x}; argument storages: "
                + ", ".join(f"[{int(s):#x}, {int(e):#x})" for s, e in zip(starts, ends)) + ")")

    # The cache arguments after ``other``/``mask`` differ between Triton releases (3.9: a cache
    # policy; 3.6: a cache modifier and an eviction policy): pass them through as they come.
    def create_masked_load(self, ptrs, mask, other, *cache_args):
        check("load", ptrs, mask)
        return original_load(self, ptrs, mask, other, *cache_args)

    def create_masked_store(self, ptrs, value, mask, *cache_args):
        check("store", ptrs, mask)
        return original_store(self, ptrs, value, mask, *cache_args)

    interpreter.GridExecutor._init_args_hst = init_args_hst
    interpreter.GridExecutor.__call__ = call
    interpreter.InterpreterBuilder.create_masked_load = create_masked_load
    interpreter.InterpreterBuilder.create_masked_store = create_masked_store
    _installed = True
