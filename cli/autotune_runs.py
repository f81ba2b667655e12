"""What ``autotune tune`` and ``autotune bench`` share: the GPU they refuse to run without, the
versions and git revision they record, and how they notice a launch that broke the CUDA
context."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import torch

from dynctx.kernels import autotune
from dynctx.kernels.backend import HAS_TRITON, triton_interpreting
from dynctx.kernels.registry import import_kernel_modules, select_tunings

EXIT_NO_GPU = 2
# The folder this package was installed from: a checkout in an editable install, else
# site-packages (where `git` finds nothing and the revision is "unknown").
SOURCE_ROOT = autotune.PACKAGED_DIR.parent


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def git_revision() -> str:
    """``$DYNCTX_GIT_REVISION``, else ``git rev-parse HEAD`` (``+dirty`` when the working tree
    differs from it, untracked files included), else ``"unknown"`` (the device machine gets no
    ``.git``)."""
    if os.environ.get("DYNCTX_GIT_REVISION"):
        return os.environ["DYNCTX_GIT_REVISION"]
    try:
        head = subprocess.run(["git", "-C", str(SOURCE_ROOT), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(SOURCE_ROOT), "status", "--porcelain"],
                               check=True, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    import dynctx

    triton_version = "none"
    if HAS_TRITON:
        import triton

        triton_version = triton.__version__
    return {"dynctx": dynctx.__version__, "git_revision": git_revision(),
            "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton_version, "cuda": torch.version.cuda or "none"}


def refuse_without_gpu(command: str) -> bool:
    """True (after saying why on stderr) when ``command`` cannot time compiled kernels here."""
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    elif triton_interpreting():
        reason = "TRITON_INTERPRET is set: interpreter timings measure nothing"
    elif not HAS_TRITON:
        reason = "triton is not installed"
    if reason:
        note(f"dynctx autotune {command}: refused: {reason}. `{command}` times compiled Triton "
             "kernels and needs a CUDA GPU; `show` and `check` run anywhere.")
        return True
    return False


class CudaContextLost(RuntimeError):
    """A launch faulted (an illegal address, say): nothing more can run in this process."""


def gpu_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:limit]


def cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # a fault (illegal address) poisons the CUDA context for good
        return False


def start_gpu_run(args):
    """``(started, tunings, device, dev)`` of a tune or bench run: its start time, the selected
    kernel tunings, the GPU and that GPU's config-folder name."""
    started = time.monotonic()
    import_kernel_modules()
    tunings = select_tunings(args.kernel, args.preset)
    device = gpu_device()
    return started, tunings, device, autotune.device_name(device)


def progress(items: list, description: str):
    """``items`` under a tqdm bar on a terminal; in a log (or without tqdm) the items alone."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    # disable=None: a bar on a terminal, nothing in a log file (the per-key line says it all).
    return tqdm(items, desc=description, unit="config", leave=False, disable=None,
                file=sys.stderr, dynamic_ncols=True)
