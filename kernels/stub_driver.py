"""A Triton driver that compiles for a GPU and never launches: GPU builds on a machine without one.

While ``stub_driver()`` is active, a launcher called with CPU tensors and ``backend="triton"``
(``TRITON_INTERPRET`` unset) runs its whole host path (checks, config lookup, grid), Triton's
JIT specialises and compiles the kernel for the stub's target (sm_90 by default) with the
ptxas Triton ships, and the launch itself only records the kernel, its grid and its build.
Nothing runs, so tensor values never matter, only their shapes, dtypes, strides and alignment.

Two uses: checking that every config builds within the target's limits
(``tests/kernels/test_sm90_build.py``, with ``resource_usage`` reading registers, stack and
spills from the cubin) and timing the host cost of a launch (``bench/launch_overhead.py``).
Each stub takes a device key of its own in every kernel's JIT cache, so it never shares
compiled kernels (or their no-op launchers) with a real device or another stub in the same
process; Triton's on-disk cache still serves the binaries.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ._common import GRID_LIMITS  # noqa: F401  (the build test checks launches against them)
from .backend import HAS_TRITON

# Each stub gets a device key of its own in the kernels' JIT caches: a kernel compiled under
# one stub keeps that stub's launcher, which records into that stub's record.
_STUB_IDS = itertools.count()

# sm_90 (H100/H200): shared memory per block (opt-in) and threads per block.
SM90_SHARED_LIMIT = 227 * 1024
MAX_THREADS_PER_BLOCK = 1024


@dataclass
class Build:
    """One compiled specialisation: the kernel's name, its launch options and the binary."""

    kernel: str
    num_warps: int
    num_stages: int
    shared: int
    metadata: Any = field(repr=False)
    cubin: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class Launch:
    """One stubbed launch: the build it would run, its grid and its arguments as the driver's
    launcher got them (every kernel parameter in order; a tensor as ``("ptr", address)``)."""

    build: Build
    grid: tuple[int, int, int]
    args: tuple = field(default=(), compare=False, repr=False)


@dataclass
class StubRecord:
    """What happened while the stub was active: every build (one per new JIT specialisation,
    i.e. a compile) and every launch, in order."""

    builds: list[Build] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)

    def compiles_of(self, kernel: str) -> int:
        return sum(build.kernel == kernel for build in self.builds)


if HAS_TRITON:
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver as _triton_driver

    SM90 = GPUTarget("cuda", 90, 32)

    class _StubUtils:
        """The driver utilities Triton calls when it loads a kernel: properties of the target
        and a module load that returns no handles."""

        def __init__(self, shared_limit: int, record: StubRecord):
            self.shared_limit = shared_limit
            self.record = record

        def get_device_properties(self, device):
            return {"max_shared_mem": self.shared_limit, "multiprocessor_count": 132,
                    "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 0,
                    "mem_clock_rate": 0, "mem_bus_width": 0}

        def load_binary(self, name, kernel, shared, device):
            # Triton calls this right after it made the kernel's launcher: the cubin is the
            # newest build's.
            self.record.builds[-1].cubin = kernel
            # A module handle that is not None: Triton loads a kernel whose module is None again.
            return name, name, 0, 0, MAX_THREADS_PER_BLOCK

        def unload_module(self, module):
            return None

    class StubDriver(DriverBase):
        """Triton's driver interface for ``target``, with a launcher that records and returns."""

        # backend.stub_driver_active() looks for this attribute on Triton's active driver.
        COMPILE_ONLY = True

        def __init__(self, target=None, shared_limit: int = SM90_SHARED_LIMIT,
                     record_launches: bool = True):
            super().__init__()
            self.target = target if target is not None else SM90
            self.record = StubRecord()
            self.utils = _StubUtils(shared_limit, self.record)
            self.device = f"stub:{self.target.backend}:{self.target.arch}:{next(_STUB_IDS)}"
            record = self.record

            class _Launcher:
                def __init__(self, src, metadata):
                    self.build = Build(kernel=metadata.name, num_warps=metadata.num_warps,
                                       num_stages=metadata.num_stages, shared=metadata.shared,
                                       metadata=metadata)
                    record.builds.append(self.build)

                def __call__(self, grid_0, grid_1, grid_2, stream, function, packed_metadata,
                             launch_metadata, enter_hook, exit_hook, *args):
                    # The launch hooks, as Triton's CUDA launcher calls them.
                    if enter_hook is not None:
                        enter_hook(launch_metadata)
                    if record_launches:
                        record.launches.append(Launch(
                            self.build, (grid_0, grid_1, grid_2),
                            tuple(("ptr", arg.data_ptr()) if hasattr(arg, "data_ptr") else arg
                                  for arg in args)))
                    if exit_hook is not None:
                        exit_hook(launch_metadata)

            self.launcher_cls = _Launcher

        @classmethod
        def is_active(cls):
            return False  # never picked by Triton itself; stub_driver() installs it

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self):
            return self.target

        def get_active_torch_device(self):
            import torch
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("the stub driver launches nothing: there is nothing to time")

        def get_current_device(self):
            return self.device

        def get_current_stream(self, device=None):
            return 0

        def set_current_device(self, device):
            return None

        def get_device_capability(self, device=None):
            return divmod(self.target.arch, 10)

    @contextlib.contextmanager
    def stub_driver(target=None, shared_limit: int = SM90_SHARED_LIMIT,
                    record_launches: bool = True) -> Iterator[StubDriver]:
        """Make a ``StubDriver`` Triton's active driver inside the block; restore the previous
        one after. Yields the driver; ``driver.record`` collects builds and (unless
        ``record_launches`` is False, for timing) launches."""
        stub = StubDriver(target, shared_limit, record_launches)
        previous = _triton_driver._active
        _triton_driver.set_active(stub)
        try:
            yield stub
        finally:
            _triton_driver._active = previous


_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def cuobjdump_path() -> Path:
    """Triton's bundled ``cuobjdump`` (the one ``triton.backends.nvidia`` ships)."""
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "bin" / "cuobjdump"


def cuobjdump(build: Build, option: str) -> str:
    """What Triton's ``cuobjdump`` prints with ``option`` (``-res-usage``, ``-sass``) for a
    build's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(build.cubin)
        path = f.name
    try:
        return subprocess.run([str(cuobjdump_path()), option, path], check=True,
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(path)


def resource_usage(build: Build) -> dict[str, int]:
    """Registers, stack frame, static shared and local bytes per thread of a build's cubin
    (``cuobjdump -res-usage``), and its spill stores and loads in bytes.

    A spill needs a stack frame, so a build with none has no spill; a stack frame alone is no
    spill (libdevice's sin/cos keep a small array there, 64-bit division saves registers): for
    those the build's PTX goes through ptxas again, as Triton ran it, for ptxas's own count."""
    text = cuobjdump(build, "-res-usage")
    match = _RES_USAGE.search(text)
    if match is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line: {text!r}")
    registers, stack, shared, local = (int(x) for x in match.groups())
    usage = {"registers": registers, "stack": stack, "shared": shared, "local": local,
             "spill_stores": 0, "spill_loads": 0}
    if stack or local:
        usage["spill_stores"], usage["spill_loads"] = _ptxas_spills(build)
    return usage


def _ptxas_spills(build: Build) -> tuple[int, int]:
    """(spill stores, spill loads) in bytes, from ptxas ``-v`` on the build's PTX, compiled
    through Triton's own ``make_cubin`` (its ptxas and flags) with the log printed."""
    import io

    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.cache import get_cache_manager

    metadata = build.metadata
    ptx_path = get_cache_manager(metadata.hash).get_file(f"{metadata.name}.ptx")
    if ptx_path is None:
        raise RuntimeError(f"{build.kernel}: no PTX in Triton's cache for hash {metadata.hash}")
    backend = make_backend(metadata.target)
    options = backend.parse_options(metadata._asdict())
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        backend.make_cubin(Path(ptx_path).read_text(), {}, options, metadata.target.arch)
    found = _SPILLS.findall(log.getvalue())
    if not found:
        raise RuntimeError(f"{build.kernel}: ptxas -v printed no spill line: {log.getvalue()!r}")
    return sum(int(s) for s, _ in found), sum(int(load) for _, load in found)
