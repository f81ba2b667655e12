"""One kernel call of a launch plan (``launch_plan.py``): made once through Triton, replayed.

``KernelLaunch`` calls the ``CompiledKernel`` that Triton's ``JITFunction.run`` returned,
the way that ``run`` does (the same in Triton 3.6 and 3.9: ``kernel.run(grid_0, grid_1,
grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, enter_hook,
exit_hook, *args)``, every kernel parameter in order, constexprs included), which also skips
Triton's own binding. It reads the current device and stream at every launch (a CUDA graph
captures on its own stream) and goes through Triton again when the device changed; while
Triton's launch-hook chains are empty it hands the launcher no hooks and builds no launch
metadata (nothing would read them), as soon as a profiler joins one it does as ``run``. Under
``TRITON_INTERPRET=1`` there is no compiled kernel: the plan calls the kernel through Triton
with its stored arguments. Triton's knobs (``debug``, instrumentation) are read, and its check
that a kernel's globals did not change is made, when a launch is made.

A launch whose counts change from call to call (paged attention's splits of the keys, the
query tiles of a prefill) need not go through Triton again: ``varied(grid, **values)`` is the
same launch with another grid and other values of some scalar arguments, kept only where
Triton would pick the same compiled kernel for them (each value specialised as ``run``
specialises it: an argument marked ``do_not_specialize`` keeps its kernel while its integer
type, 32 or 64 bits, stays).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Iterable

import torch

from .backend import HAS_TRITON

if HAS_TRITON:
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime import driver as _DRIVERS
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    try:
        from triton.knobs import HookChain as _HookChain
    except ImportError:  # hooks of another kind: every launch builds their metadata
        _HookChain = None


def _unwrap(kernel, kwargs: dict) -> tuple[Any, dict]:
    """The ``JITFunction`` under ``@triton.heuristics`` layers and the keyword arguments it
    gets from them (each heuristic evaluated as ``Heuristics.run`` does)."""
    kwargs = dict(kwargs)
    while isinstance(kernel, Heuristics):
        for name, heuristic in kernel.values.items():
            kwargs[name] = heuristic(kwargs)
        kernel = kernel.fn
    return kernel, kwargs


def _role_of(name: str, value, roles: dict) -> str:
    for role, tensor in roles.items():
        if tensor is value:
            return role
    raise ValueError(f"pointer argument {name} is none of the tensors {sorted(roles)}")


def tensor_arguments(kwargs: dict) -> tuple[str, ...]:
    """The names of the tensor values of ``kwargs``: a kernel call's pointers."""
    return tuple(name for name, value in kwargs.items() if isinstance(value, torch.Tensor))


class KernelLaunch:
    """One kernel call of a plan: launched once through Triton when made, then replayed with
    new pointers by ``launch(pointers)``.

    ``pointer_names`` are the kernel arguments that change from call to call (the tensors,
    whose addresses move); ``launch`` takes them in that order, as a tuple. Every other
    argument is fixed by the launch key and kept.
    """

    __slots__ = ("kernel", "grid", "kwargs", "pointer_names", "roles", "_pick", "_compiled",
                 "_fixed", "_permute", "_device", "_grid3", "_run", "_function", "_packed")

    def __init__(self, kernel, grid: tuple[int, ...], kwargs: dict, pointer_names: Iterable[str],
                 roles: dict | None = None):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.pointer_names = tuple(pointer_names)
        # With ``roles`` (role name -> this call's tensor), each pointer is named by the role
        # whose tensor it is, and ``launch_with({role: tensor})`` launches a later call.
        self.roles = None if roles is None else tuple(
            _role_of(name, kwargs[name], roles) for name in self.pointer_names)
        missing = [name for name in self.pointer_names if name not in kwargs]
        if missing:
            raise ValueError(f"pointer arguments {missing} are not among the kernel's arguments")
        unnamed = [name for name, value in kwargs.items()
                   if isinstance(value, torch.Tensor) and name not in self.pointer_names]
        if unnamed:
            raise ValueError(f"tensor arguments {unnamed} are not named as pointers: a plan "
                             "would launch later calls with this call's tensors")
        # Kept without the pointers: a plan must not hold the tensors of the call that made it.
        self.kwargs = {name: value for name, value in kwargs.items()
                       if name not in self.pointer_names}
        self._compiled = None
        jit, full = _unwrap(kernel, kwargs)
        if isinstance(jit, JITFunction):
            if self.roles is not None:
                # Taken by role, the pointers can come in the kernel's order: a launch is then
                # the pointers followed by the fixed arguments, with no permutation (_build).
                order = {param.name: index for index, param in enumerate(jit.params)}
                pairs = sorted(zip(self.pointer_names, self.roles), key=lambda p: order[p[0]])
                self.pointer_names = tuple(name for name, _ in pairs)
                self.roles = tuple(role for _, role in pairs)
            self._build(jit, full)
        else:
            # The interpreter (TRITON_INTERPRET=1): Triton runs the kernel itself.
            kernel[self.grid](**kwargs)
        self._pick = None if not self.roles else (
            operator.itemgetter(*self.roles) if len(self.roles) > 1
            else (lambda tensors, role=self.roles[0]: (tensors[role],)))

    def _build(self, jit, full: dict) -> None:
        """Launch once through ``jit.run`` and keep what a replay needs of its kernel."""
        device = _DRIVERS.active.get_current_device()
        compiled = jit.run(grid=self.grid, warmup=False, **full)
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return
        names = [param.name for param in jit.params]
        defaults = jit.signature.parameters
        args = [full[name] if name in full else defaults[name].default for name in names]
        slots = [names.index(name) for name in self.pointer_names]
        fixed = [index for index in range(len(names)) if index not in slots]
        # A launch's arguments: the pointers, then the fixed ones, put in the kernel's order by
        # one C-level permutation (none when the pointers come first and in order, the
        # kernels' convention).
        self._fixed = tuple(args[index] for index in fixed)
        position = {index: at for at, index in enumerate(slots + fixed)}
        order = tuple(position[index] for index in range(len(names)))
        self._permute = None if order == tuple(range(len(names))) else operator.itemgetter(*order)
        self._device = device
        self._grid3 = (self.grid + (1, 1))[:3]
        # What JITFunction.run reads from the kernel on every launch, read once.
        self._run = compiled.run
        self._function = compiled.function
        self._packed = compiled.packed_metadata
        self._compiled = compiled

    def varied(self, grid: tuple[int, ...], **values) -> "KernelLaunch | None":
        """This launch with ``grid`` and ``values`` (scalar arguments by name) in place of its
        own, made without Triton; None where Triton would pick another compiled kernel for
        them (a value of another type, or specialised otherwise: then take the full path).
        Raises ``ValueError`` for a pointer, a constexpr, or any value of a kernel under
        heuristics (which could read it): no plan may vary those."""
        jit = self.kernel
        if values and HAS_TRITON and isinstance(jit, Heuristics):
            raise ValueError(f"{jit.fn.__name__}: a kernel under heuristics takes no other "
                             "values (only another grid)")
        scalars = self._scalars if values else {}
        fixed = list(self._fixed) if self._compiled is not None else None
        for name, value in values.items():
            old = self.kwargs.get(name)
            if name not in scalars:
                raise ValueError(f"{name} is no scalar argument of {jit.fn.__name__}")
            if type(value) is not type(old) or type(value) not in (int, float):
                return None
            if fixed is not None:
                param, index, unspecialised = scalars[name]
                # An unspecialised int keeps its kernel within int32 (Triton's i32 argument);
                # anything else is compared as Triton specialises it.
                if not (unspecialised and type(value) is int and _I32 <= value < -_I32
                        and _I32 <= old < -_I32) and (
                            param.annotation_type
                            or _specialised(param, value) != _specialised(param, old)):
                    return None
                fixed[index] = value
        other = object.__new__(KernelLaunch)
        for slot in KernelLaunch.__slots__:
            # (Without a compiled kernel the replay's slots were never set.)
            if hasattr(self, slot):
                setattr(other, slot, getattr(self, slot))
        other.grid = tuple(grid)
        other.kwargs = {**self.kwargs, **values}
        if fixed is not None:
            other._fixed = tuple(fixed)
            other._grid3 = (other.grid + (1, 1))[:3]
        return other

    @property
    def _scalars(self) -> dict:
        """The arguments ``varied`` may change, by name: ``(param, index in _fixed, whether it
        is an unannotated do_not_specialize one)`` (param None under the interpreter); read
        from the kernel's signature once (it is slow)."""
        # (By the kernel's id, kept alive in the entry: hashing a JITFunction is slow.)
        key = (id(self.kernel), self.pointer_names)
        kernel, scalars = _SCALARS.get(key, (None, None))
        if kernel is not self.kernel:
            # (An interpreted kernel has no params: its signature names the constexprs.)
            signature = inspect.signature(self.kernel.fn).parameters
            params = {param.name: param for param in getattr(self.kernel, "params", ())}
            fixed = [name for name in signature if name not in self.pointer_names]
            scalars = {name: (params.get(name), fixed.index(name),
                              name in params and params[name].do_not_specialize
                              and not params[name].annotation_type)
                       for name in fixed if name in self.kwargs
                       and "constexpr" not in str(signature[name].annotation)}
            _SCALARS[key] = (self.kernel, scalars)
        return scalars

    def launch_with(self, tensors: dict) -> None:
        """``launch`` with each pointer taken from ``tensors`` by its role."""
        self.launch(self._pick(tensors))

    @property
    def direct(self) -> bool:
        """Whether ``launch`` calls the compiled kernel itself (not the interpreter)."""
        return self._compiled is not None

    def launch(self, pointers: tuple) -> None:
        compiled = self._compiled
        if compiled is None:
            self.kernel[self.grid](**self.kwargs, **dict(zip(self.pointer_names, pointers)))
            return
        active = _DRIVERS.active
        device = active.get_current_device()
        if device != self._device:
            self._rebuild(pointers)
            return
        self._replay(pointers, active.get_current_stream(device), *_launch_hooks())

    def take_by_position(self, roles: tuple) -> None:
        """Take ``launch_with``'s pointers from a tuple laid out as ``roles`` (role names)
        instead of a dict: a tuple is cheaper to build per call."""
        positions = tuple(roles.index(role) for role in self.roles)
        self._pick = (operator.itemgetter(*positions) if len(positions) > 1
                      else operator.itemgetter(slice(positions[0], positions[0] + 1)))

    def _rebuild(self, pointers: tuple) -> None:
        """Another current device: Triton compiles (or finds) the kernel for it, once."""
        self._compiled = None
        self._build(*_unwrap(self.kernel, {**self.kwargs,
                                           **dict(zip(self.pointer_names, pointers))}))

    def _replay(self, pointers: tuple, stream, enter, leave, read: bool) -> None:
        args = pointers + self._fixed
        if self._permute is not None:
            args = self._permute(args)
        metadata = self._compiled.launch_metadata(self.grid, stream, *args) if read else None
        grid_0, grid_1, grid_2 = self._grid3
        self._run(grid_0, grid_1, grid_2, stream, self._function, self._packed, metadata, enter,
                  leave, *args)


def _launch_hooks() -> tuple:
    """``(enter, leave, read)``: the launch hooks to hand the launcher and whether one reads
    the launch's metadata. As JITFunction.run does, the hooks (a profiler's) get it from
    CompiledKernel.launch_metadata (None without an enter hook). Triton's hooks are chains,
    empty unless something joined one: then the launcher is handed none (it calls a hook that
    is not None, and an empty chain does nothing) and no metadata is built."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    if (type(enter) is _HookChain and not enter.calls and type(leave) is _HookChain
            and not leave.calls):
        return None, None, False
    return enter, leave, enter is not None


def launch_all(launches: tuple, tensors) -> None:
    """``launch_with(tensors)`` of each of ``launches`` in order (the kernel calls of one
    plan, each calling its compiled kernel), the current device, stream and launch hooks read
    once for all of them."""
    active = _DRIVERS.active
    device = active.get_current_device()
    stream = active.get_current_stream(device)
    enter, leave, read = _launch_hooks()
    for launch in launches:
        if launch._device != device:
            launch._rebuild(launch._pick(tensors))
        else:
            launch._replay(launch._pick(tensors), stream, enter, leave, read)


# KernelLaunch._scalars per (kernel, pointer names): a few dozen kernels in a process.
_SCALARS: dict = {}
# The least int32: Triton passes an int in [_I32, -_I32) as i32, a larger one as i64 or u64.
_I32 = -2 ** 31


def _specialised(param, value) -> tuple:
    """What ``JITFunction.run`` makes of ``value`` for ``param`` in its kernel's cache key
    (the type, and what it specialises on: 1, divisibility by 16, unless told not to)."""
    return tuple(native_specialize_impl(BaseBackend, value, param.is_const,
                                        not param.do_not_specialize,
                                        not param.do_not_specialize_on_alignment))
