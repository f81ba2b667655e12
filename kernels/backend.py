"""Kernel backend selection: compiled Triton on CUDA, the torch reference on a CPU.

``backend`` (a launcher argument or a context argument) is one of ``"auto"``, ``"triton"`` or
``"torch"``; ``None`` reads the ``DYNCTX_KERNEL_BACKEND`` environment variable (default
``"auto"``). ``"auto"`` runs Triton on CUDA tensors and the torch reference elsewhere.
``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` set before import (the tests do this),
or the compile-only driver of ``stub_driver.py`` active (builds for a GPU, launches nothing).
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    from triton.runtime import driver as _triton_driver

    HAS_TRITON = True
except ImportError:  # macOS and other platforms without Triton wheels
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")
BACKEND_ENV = "DYNCTX_KERNEL_BACKEND"

# os.environ's own store (bytes on POSIX), which os.environ[...] = and putenv keep current: a
# launch reads a few variables, and os.environ.get's encode/decode costs ~0.4 us each.
_ENV_STORE = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENCODED: dict[str, bytes] = {}


def env_get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, read without the encoding round trip on POSIX."""
    if _ENV_STORE is None:
        return os.environ.get(name, default)
    encoded = _ENCODED.get(name)
    if encoded is None:
        encoded = _ENCODED[name] = os.fsencode(name)
    value = _ENV_STORE.get(encoded)
    return default if value is None else os.fsdecode(value)


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return env_get("TRITON_INTERPRET", "0") not in ("", "0")


def stub_driver_active() -> bool:
    """True while ``stub_driver.stub_driver()`` has made its compile-only driver Triton's."""
    return HAS_TRITON and getattr(_triton_driver._active, "COMPILE_ONLY", False)


def check_backend_name(backend: str | None, argument: str = "backend") -> str:
    """``backend`` (None: ``$DYNCTX_KERNEL_BACKEND``, else ``"auto"``) when it is one of
    ``BACKENDS``, else ``ValueError`` naming ``argument`` (or the variable) and the choices."""
    name = backend if backend is not None else env_get(BACKEND_ENV, "auto")
    if not isinstance(name, str) or name not in BACKENDS:
        source = argument if backend is not None else BACKEND_ENV
        raise ValueError(f"{source}={name!r} is not a kernel backend; expected one of {BACKENDS}")
    return name


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Return ``"triton"`` or ``"torch"`` for tensors on ``device``."""
    name = check_backend_name(backend)
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if (HAS_TRITON and device.type == "cuda") else "torch"
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' was asked for but triton is not installed")
    if device.type != "cuda" and not triton_interpreting() and not stub_driver_active():
        raise RuntimeError(
            f"backend='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 set before "
            "dynctx is imported (or use backend='torch')"
        )
    return "triton"
