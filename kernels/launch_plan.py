"""Per-key launch plans: what a launcher decides once for a key, replayed on the next call.

A launcher's host work before a kernel call (argument checks, the tuned-config lookup, the
grid, the strides and sizes it passes, Triton's binding and specialisation of ~30 arguments)
depends only on the *metadata* of its arguments: dtypes, devices, shapes, strides, 16-byte
alignment, the scalar arguments and the counts that pick the grid. A launcher builds that
metadata into a key (``tensor_meta`` per tensor), looks it up in its own ``PlanCache``, and
on a miss runs its whole path once and stores a plan: the config and, per kernel call, a
``KernelLaunch`` holding the compiled kernel, its grid and every argument but the pointers.
A hit builds the key, does one dict lookup and launches the compiled kernel with the call's
tensors in the pointer slots. So a bad call of a shape seen before (another dtype, device,
stride or a ``None``) has another key, misses, and is refused by the checks as before;
nothing that depends on tensor contents is in a plan.

``KernelLaunch`` calls the ``CompiledKernel`` that Triton's ``JITFunction.run`` returned,
the way that ``run`` does (the same in Triton 3.6 and 3.9: ``kernel.run(grid_0, grid_1,
grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, enter_hook,
exit_hook, *args)``, every kernel parameter in order, constexprs included), which also skips
Triton's own binding. It reads the current device and stream at every launch (a CUDA graph
captures on its own stream) and goes through Triton again when the device changed. Under
``TRITON_INTERPRET=1`` there is no compiled kernel: the plan calls the kernel through Triton
with its stored arguments. Triton's knobs (``debug``, instrumentation) are read, and its check
that a kernel's globals did not change is made, when a plan is made; ``clear_plans()`` forgets
every plan (call it after changing either).

Each launcher module owns its ``PlanCache`` (an LRU of at most ``capacity`` keys); the caches
register here only so that ``clear_plans()`` and ``plan_caches()`` can reach them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Iterable

import torch

from . import autotune
from .autotune import KernelConfig
from .backend import HAS_TRITON, env_get

# Keys per launcher: a run sees a few dozen token counts per launcher (decode batch sizes,
# prefill chunks); the LRU keeps the recent ones.
DEFAULT_CAPACITY = 256
# Set to "0" to turn plans off (every call takes the full path): for A/B checks and bisecting.
PLANS_ENV = "DYNCTX_LAUNCH_PLANS"

_CACHES: "weakref.WeakSet[PlanCache]" = weakref.WeakSet()


class Uncacheable:
    """A key part for an argument that no plan may cover (not a plain tensor): its call takes
    the full path every time. Never equal to anything, itself included."""

    __slots__ = ()

    def __eq__(self, other):
        return False

    def __hash__(self):
        return 0


UNCACHEABLE = Uncacheable()


def tensor_meta(t) -> tuple | None:
    """The metadata of ``t`` a launcher's checks and Triton's specialisation can see:
    ``(dtype, device, shape, strides, data_ptr % 16)``; ``None`` for ``None``; ``UNCACHEABLE``
    for anything else (a tensor subclass, a wrong type: the full path checks it)."""
    if type(t) is torch.Tensor:
        return (t.dtype, t.device, t.shape, t.stride(), t.data_ptr() & 15)
    return None if t is None else UNCACHEABLE


def scalar_meta(x):
    """A scalar argument as a key part: a plain ``bool``/``int``/``float``/``str``/``None`` as
    itself (with its type: ``1`` and ``True`` differ), anything else (a tensor, whose contents
    could change under the same object) ``UNCACHEABLE``."""
    if x is None or type(x) in (bool, int, float, str):
        return (type(x), x)
    return UNCACHEABLE


def config_meta(config):
    """A launcher's ``config`` argument as a key part: a ``KernelConfig`` as itself; ``None``
    (resolve it) as the lookup state it resolves under (``autotune.lookup_state()``)."""
    if config is None:
        return autotune.lookup_state()
    return config if type(config) is KernelConfig else UNCACHEABLE


_SCALAR_TYPES = frozenset((bool, int, float, str, type(None)))
_Tensor = torch.Tensor


def launch_key(tensors: tuple, scalars: tuple = (), config=None) -> tuple | None:
    """A launcher's key: ``tensor_meta`` of each of ``tensors`` (``None`` allowed),
    ``scalar_meta`` of each of ``scalars`` and ``config_meta(config)``; ``None`` (no plan:
    the full path every time) when any part is ``UNCACHEABLE``.

    The hot path of every launch: ``tensor_meta`` and ``scalar_meta`` are written out inline
    (a call each would cost more than the attribute reads) for the common types."""
    key = (*[(t.dtype, t.device, t.shape, t.stride(), t.data_ptr() & 15)
             if type(t) is _Tensor else tensor_meta(t) for t in tensors],
           *[(type(x), x) if type(x) in _SCALAR_TYPES else scalar_meta(x) for x in scalars],
           config_meta(config))
    for part in key:
        if part is UNCACHEABLE:
            return None
    return key


def plans_enabled() -> bool:
    return env_get(PLANS_ENV, "1") != "0"


class PlanCache:
    """A bounded LRU from launch key to plan, owned by one launcher module."""

    def __init__(self, name: str, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"PlanCache {name!r}: capacity={capacity} must be >= 1")
        self.name = name
        self.capacity = capacity
        self._plans: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0
        _CACHES.add(self)

    def get(self, key):
        """The plan stored for ``key`` (now the most recent), or None; None for a ``None`` key
        (``launch_key``'s answer for an argument no plan may cover)."""
        plan = None if key is None else self._plans.get(key)
        if plan is None:
            self.misses += 1
            return None
        self.hits += 1
        self._plans.move_to_end(key)
        return plan

    def put(self, key, plan) -> None:
        if key is None or not plans_enabled():
            return
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __repr__(self) -> str:
        return (f"PlanCache({self.name!r}, {len(self)}/{self.capacity} plans, "
                f"{self.hits} hits, {self.misses} misses)")


def plan_caches() -> dict[str, PlanCache]:
    return {cache.name: cache for cache in _CACHES}


def clear_plans() -> None:
    """Forget every launcher's plans: the next calls take the full path and plan again."""
    for cache in list(_CACHES):
        cache.clear()


if HAS_TRITON:
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction


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
    whose addresses move); ``launch`` takes them in that order. Every other argument is fixed
    by the launch key and kept.
    """

    __slots__ = ("kernel", "grid", "kwargs", "pointer_names", "roles", "_compiled", "_args",
                 "_slots", "_device", "_grid3")

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
            device = driver.active.get_current_device()
            compiled = jit.run(grid=self.grid, warmup=False, **full)
            if compiled is not None and hasattr(compiled, "packed_metadata"):
                names = [param.name for param in jit.params]
                defaults = jit.signature.parameters
                self._args = [full[name] if name in full else defaults[name].default
                              for name in names]
                self._slots = tuple(names.index(name) for name in self.pointer_names)
                for slot in self._slots:
                    self._args[slot] = None
                self._device = device
                self._grid3 = (self.grid + (1, 1))[:3]
                self._compiled = compiled
        else:
            # The interpreter (TRITON_INTERPRET=1): Triton runs the kernel itself.
            kernel[self.grid](**kwargs)

    def launch_with(self, tensors: dict) -> None:
        """``launch`` with each pointer taken from ``tensors`` by its role."""
        self.launch(tuple(tensors[role] for role in self.roles))

    @property
    def direct(self) -> bool:
        """Whether ``launch`` calls the compiled kernel itself (not the interpreter)."""
        return self._compiled is not None

    def launch(self, pointers: tuple) -> None:
        compiled = self._compiled
        if compiled is None:
            self.kernel[self.grid](**self.kwargs, **dict(zip(self.pointer_names, pointers)))
            return
        active = driver.active
        device = active.get_current_device()
        if device != self._device:
            # Another current device: Triton compiles (or finds) the kernel for it, once.
            roles = self.roles
            self.__init__(self.kernel, self.grid,
                          {**self.kwargs, **dict(zip(self.pointer_names, pointers))},
                          self.pointer_names)
            self.roles = roles
            return
        args = self._args.copy()
        for slot, pointer in zip(self._slots, pointers):
            args[slot] = pointer
        stream = active.get_current_stream(device)
        # As JITFunction.run does (the launch hooks, a profiler's, get what they get from it).
        metadata = compiled.launch_metadata(self.grid, stream, *args)
        grid_0, grid_1, grid_2 = self._grid3
        compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                     metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
                     *args)
