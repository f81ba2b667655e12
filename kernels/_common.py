"""Helpers shared by the kernel files: sizes, argument checks and tune-case plumbing.

Nothing here launches a kernel; each launcher still owns its contract (docs/DESIGN.md §4)
and calls these helpers for the checks that several launchers state in the same words.
"""

from __future__ import annotations

import torch

from .autotune import KernelConfig, TuneCase
from .devices import same_device

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# CUDA's limits on the programs of a launch grid, per axis (x, y, z).
GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)


class _RegisteredElsewhere:
    """An op that an earlier execution of the same kernel module registered (see ``custom_op``):
    calls go to that registration, and the fake implementation stays the one registered with it."""

    def __init__(self, namespace: str, name: str):
        self._namespace, self._name = namespace, name

    def register_fake(self, fn):
        return fn

    def __call__(self, *args, **kwargs):
        return getattr(getattr(torch.ops, self._namespace), self._name)(*args, **kwargs)


def custom_op(qualname: str, *, mutates_args):
    """``torch.library.custom_op`` that registers each name once per process.

    A kernel module can run twice in one process: from a checkout, ``kernels/`` is importable as
    the top-level package ``kernels`` whenever the working directory is on ``sys.path`` (any
    ``python -m ...`` started in the repository root), and transformers imports a top-level
    ``kernels`` it finds when it probes for the Hugging Face ``kernels`` library. Registering a
    name again makes torch destroy the first registration, and every op handle taken before it
    (module-level ``torch.ops.dynctx.*`` aliases, compiled graphs) then points at a freed
    dispatcher entry: a use-after-free that shows up as random segfaults, "Tried to access the
    schema for  which doesn't have a schema registered yet" or ``vector::reserve``. So a name
    that is registered already is kept, and the second module's function is not registered.
    """
    namespace, name = qualname.split("::")
    if hasattr(getattr(torch.ops, namespace), name):
        return lambda fn: _RegisteredElsewhere(namespace, name)
    return torch.library.custom_op(qualname, mutates_args=mutates_args)


def next_pow2(x: int) -> int:
    """The smallest power of two ``>= x`` (1 for ``x <= 1``): Triton block sizes."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Integer view of the same bytes, so NaN payloads and -0.0 compare exactly."""
    return tensor.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[tensor.element_size()])


def squeeze_singleton(name: str, tensor: torch.Tensor, dims: int, layout: str) -> torch.Tensor:
    """``[n, 1, *rest]`` -> a ``[n, *rest]`` view; otherwise ``tensor`` must have ``dims`` dims.

    ``layout`` names ``rest`` in the error, e.g. ``"H, D"`` for ``[n, H, D] or [n, 1, H, D]``.
    """
    if tensor.dim() == dims + 1 and tensor.shape[1] == 1:
        return tensor[:, 0]
    if tensor.dim() != dims:
        raise ValueError(f"{name} must be [n, {layout}] or [n, 1, {layout}], "
                         f"got shape {tuple(tensor.shape)}")
    return tensor


def check_tensor(name: str, t, *, dims: int, dtypes: tuple, device: torch.device, device_of: str,
                 min_rows: int = 0) -> None:
    """``t`` must be a ``dims``-D tensor of one of ``dtypes`` on ``device`` (the device of the
    argument ``device_of``) with at least ``min_rows`` rows; raise ``ValueError`` naming it."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if not same_device(t.device, device):
        raise ValueError(f"{name} is on {t.device}, {device_of} on {device}")
    if t.shape[0] < min_rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, needs at least {min_rows}")


def check_block_slots(block_ids: torch.Tensor, slots: torch.Tensor) -> int:
    """Check the ``[n]`` int32/int64 (block, slot) targets of a paged-cache write; return ``n``."""
    n = block_ids.numel()
    for name, tensor in (("block_ids", block_ids), ("slots", slots)):
        if tensor.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
        if tensor.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} dtype {tensor.dtype} must be int32 or int64")
    if slots.numel() != n:
        raise ValueError(f"slots has {slots.numel()} entries, block_ids {n}")
    return n


def check_writable(*named) -> None:
    """Each ``(name, tensor)`` written in place must give every element its own address: a dim
    of stride 0 and size > 1 (an ``expand``ed view) would have programs race on one element
    (the torch reference raises on such a tensor too)."""
    for name, tensor in named:
        shared = [d for d, (size, stride) in enumerate(zip(tensor.shape, tensor.stride()))
                  if size > 1 and stride == 0]
        if shared:
            raise ValueError(f"{name} is written in place but dim {shared[0]} has stride 0 "
                             f"(shape {tuple(tensor.shape)}, strides {tensor.stride()}): several "
                             "elements share one address; pass a tensor that owns each element")


def check_grid(kernel: str, grid: tuple[int, ...], sizes: str) -> None:
    """Raise ``ValueError`` when an axis of ``grid`` is over CUDA's limit; ``sizes`` names the
    arguments that made it so."""
    for axis, (programs, limit) in enumerate(zip(grid, GRID_LIMITS)):
        if programs > limit:
            raise ValueError(f"{kernel}: {sizes} needs {programs} programs on grid axis {axis}, "
                             f"over CUDA's limit of {limit}")


def check_same_device(tensors, ref_name: str, ref: torch.Tensor) -> None:
    """Each ``(name, tensor)`` of ``tensors`` must sit on ``ref``'s device."""
    for name, tensor in tensors:
        if not same_device(tensor.device, ref.device):
            raise ValueError(f"{name} is on {tensor.device}, {ref_name} on {ref.device}")


def paged_targets(n: int, block_size: int, gen: torch.Generator):
    """``(num_blocks, block_ids, slots)`` for a tune case, every (block, slot) distinct: decode-like
    tokens in distinct blocks up to 256 tokens, prefill-like runs of whole blocks beyond."""
    if n <= 256:
        num_blocks = 2 * n + 1
        block_ids = torch.randperm(num_blocks, generator=gen)[:n]
        slots = torch.randint(0, block_size, (n,), generator=gen)
    else:
        num_blocks = -(-n // block_size) + 1
        block_ids = torch.randperm(num_blocks, generator=gen)[torch.arange(n) // block_size]
        slots = torch.arange(n) % block_size
    return num_blocks, block_ids, slots


class BufferWriteCase(TuneCase):
    """A data-movement tune case that writes into ``self.buffer``: ``check`` runs the reference
    and then the kernel, each from the contents of ``self.initial``, and compares the buffers
    bit for bit. Subclasses set ``NAME`` (the launcher; its reference is ``NAME + "_ref"``),
    ``buffer``, ``initial``, ``run`` and ``run_reference``."""

    NAME = ""

    def check(self, config: KernelConfig) -> None:
        self.buffer.copy_(self.initial)
        self.run_reference()
        expected = self.buffer.clone()
        self.buffer.copy_(self.initial)
        self.run(config)
        assert torch.equal(bits(self.buffer), bits(expected)), \
            f"{self.NAME} with {config} differs from {self.NAME}_ref"
