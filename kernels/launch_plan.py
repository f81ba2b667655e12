"""Per-key launch plans: what a launcher decides once for a key, replayed on the next call.

A launcher's host work before a kernel call (argument checks, the tuned-config lookup, the
grid, the strides and sizes it passes, Triton's binding and specialisation of ~30 arguments)
depends only on the *metadata* of its arguments: dtypes, devices, shapes, strides, 16-byte
alignment, the scalar arguments and the counts that pick the grid, and on the process state
``launch_state()`` names (the config lookup's generation and folders, the backend variable,
Triton's active driver). A launcher asks its own ``PlanCache`` with ``find(tensors,
scalars, config)``; on a miss it runs its whole path once and stores a plan under the key
``find`` gave: the config and, per kernel call, a ``KernelLaunch`` holding the compiled
kernel, its grid and every argument but the pointers. A hit launches the compiled kernel with
the call's tensors in the pointer slots. So a bad call of a shape seen before (another dtype,
device, stride or a ``None``) has another key, misses, and is refused by the checks as before;
nothing that depends on tensor contents is in a plan.

``find`` looks in two places. First the few most recent plans (``RECENT``), each with a guard
made when it was promoted there: torch's C++ tensor check (the one ``torch.compile``'s guards
were built on: Python type, dispatch keys, so device type, device index, dtype, sizes,
strides, ``requires_grad``), the ``None`` positions, every pointer 16-byte aligned, and the
scalars, their types and the state compared as a tuple. That costs a few hundred ns for a
dozen tensors, where reading the same metadata from Python costs ~0.4 µs per tensor. Then, or
where torch lacks that check (``GUARDS`` is None: it is private to torch, so it is probed at
import and dropped if it does not refuse what it must), the LRU of keys built from Python
(``launch_key``); a hit there is promoted. Both give the same plan for the same call.

A key holds the scalar arguments as they are, but for the host lengths and counts that
change from step to step and decide nothing but a config's bucket and counts a plan can
recompute: those are in the key by class (``count_class``: the bucket of the tuning key),
and the plan keeps a launch per value, made from its first by ``KernelLaunch.varied`` after
the launcher's checks of the value (``CountPlan``; paged attention's own,
``paged_attention_plan.py``). ``KernelLaunch`` (``kernel_launch.py``) is what a plan
replays.

Each launcher module owns its ``PlanCache`` (an LRU of at most ``capacity`` keys); the caches
register here only so that ``clear_plans()`` and ``plan_caches()`` can reach them.
"""

from __future__ import annotations

import functools
import operator
import os
import weakref
from collections import OrderedDict
from typing import Any

import torch

from . import autotune
from .autotune import KernelConfig
from .backend import BACKEND_ENV, HAS_TRITON, env_get, resolve_backend
from .kernel_launch import KernelLaunch, launch_all, tensor_arguments  # noqa: F401 (re-export)

# Keys per launcher: a run sees a few dozen token counts per launcher (decode batch sizes,
# prefill chunks); the LRU keeps the recent ones.
DEFAULT_CAPACITY = 256
# Plans per launcher checked by guard before the LRU: the context calls a launcher with the
# same shapes for every layer of a step (the Mamba pair alternates two).
RECENT = 4
# Set to "0" to turn plans off (every call takes the full path): for A/B checks and bisecting.
PLANS_ENV = "DYNCTX_LAUNCH_PLANS"

_CACHES: "weakref.WeakSet[PlanCache]" = weakref.WeakSet()

if HAS_TRITON:
    from triton.runtime import driver as _DRIVERS
else:
    class _DRIVERS:  # no Triton: no driver, and no plan is ever made
        _active = None


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
    """A launcher's ``config`` argument as a key part: a ``KernelConfig`` or ``None`` (resolve
    it, under ``launch_state()``, which every key holds) as itself, anything else
    ``UNCACHEABLE``."""
    return config if config is None or type(config) is KernelConfig else UNCACHEABLE


# The variables a plan depends on: the override folder's two (the tuned config), the backend's
# (which calls run Triton at all), the interpreter's (Triton on a CPU tensor) and the plans'.
_STATE_ENV = (autotune.OVERRIDE_ENV, "XDG_CACHE_HOME", BACKEND_ENV, "TRITON_INTERPRET", PLANS_ENV)
# os.environ's own store (bytes on POSIX), kept current by os.environ[...] = and del: an
# unchanged variable reads back as the same bytes object, so comparing costs a few ns.
_ENV_STORE = getattr(os.environ, "_data", None) if os.name == "posix" else None
_STATE_KEYS = tuple(map(os.fsencode, _STATE_ENV)) if _ENV_STORE is not None else _STATE_ENV
_ENV_GET = (_ENV_STORE if _ENV_STORE is not None else os.environ).get


def launch_state() -> tuple:
    """Everything a plan depends on besides its call's arguments: the config lookup's
    generation (``autotune.clear_lookup_cache()`` bumps it), Triton's active driver and the
    variables of ``_STATE_ENV`` as stored; read in ~0.3 µs on every launch (``find`` reads
    it inline), so a changed variable is never missed."""
    return (autotune._GENERATION[0], id(_DRIVERS._active), *map(_ENV_GET, _STATE_KEYS))


_SCALAR_TYPES = frozenset((bool, int, float, str, type(None)))
_Tensor = torch.Tensor


def launch_key(tensors: tuple, scalars: tuple = (), config=None) -> tuple | None:
    """A launcher's key: ``tensor_meta`` of each of ``tensors`` (``None`` allowed),
    ``scalar_meta`` of each of ``scalars``, ``config_meta(config)`` and ``launch_state()``;
    ``None`` (no plan: the full path every time) when any part is ``UNCACHEABLE``.

    ``tensor_meta`` and ``scalar_meta`` are written out inline (a call each would cost more
    than the attribute reads) for the common types."""
    key = (*[(t.dtype, t.device, t.shape, t.stride(), t.data_ptr() & 15)
             if type(t) is _Tensor else tensor_meta(t) for t in tensors],
           *[(type(x), x) if type(x) in _SCALAR_TYPES else scalar_meta(x) for x in scalars],
           config_meta(config), launch_state())
    for part in key:
        if part is UNCACHEABLE:
            return None
    return key


def plans_enabled() -> bool:
    return env_get(PLANS_ENV, "1") != "0"


def _tensor_guards():
    """torch's C++ check of a tuple of tensors' metadata, as ``make(tensors) -> guard`` with
    ``guard.check(*tensors) -> bool``; None when torch has none, or one that lets through a
    tensor a launch key would tell apart (probed here: it is private to torch)."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None

    def make(tensors):
        return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)

    try:
        base, index = torch.zeros(4, 6), torch.zeros(3, dtype=torch.int32)
        guard = make((base, index))
        differing = [torch.zeros(4, 6, dtype=torch.float64), torch.zeros(4, 7),
                     torch.zeros(6, 4).t(), torch.zeros(4, 12)[:, ::2], torch.zeros(24),
                     torch.zeros(4, 6, device="meta"),
                     torch.nn.Parameter(torch.zeros(4, 6), requires_grad=False)]
        if not guard.check(torch.zeros(4, 6), torch.ones(3, dtype=torch.int32)):
            return None
        if any(guard.check(other, index) for other in differing):
            return None
        if guard.check(base, torch.zeros(3)) or guard.check(base, torch.zeros(3, 1)):
            return None
    except Exception:  # an API that changed shape: plans still work through the LRU
        return None
    return make


# make(tensors) -> guard, or None: the recent plans are then not kept (module docstring).
GUARDS = _tensor_guards()
_or = operator.or_
_data_ptr = torch.Tensor.data_ptr


class _Recent:
    """A plan promoted to the recent list: its call's head (state, scalar types, scalars,
    config), the positions of its ``None`` tensors, a picker of the others and their guard."""

    __slots__ = ("head", "nones", "pick", "guard", "plan")

    def __init__(self, head, tensors, plan):
        self.head = head
        self.nones = tuple(i for i, t in enumerate(tensors) if t is None)
        present = tuple(i for i, t in enumerate(tensors) if t is not None)
        # itemgetter of one index gives the item, not a 1-tuple: a slice keeps the tuple.
        self.pick = (operator.itemgetter(*present) if len(present) > 1
                     else operator.itemgetter(slice(present[0], present[0] + 1)))
        self.guard = GUARDS(self.pick(tensors))
        self.plan = plan


_NOT_GIVEN = object()


def _takes_torch(backend, tensors) -> bool:
    """Whether a launch with ``backend`` on the first of ``tensors``' devices resolves to the
    torch path; False where that resolution would raise (the full path raises it, after its
    own checks) or no tensor is given."""
    for tensor in tensors:
        if type(tensor) is _Tensor:
            try:
                return resolve_backend(backend, tensor.device) == "torch"
            except (ValueError, RuntimeError):
                return False
    return False


def _promotable(tensors) -> bool:
    """Whether a recent-list guard can stand for ``tensors``' part of a key: plain tensors (or
    ``None``), at least one, each object once (the guard refuses repeats), all 16-byte aligned
    (the guard sees no addresses; the check of a hit is that they all still are)."""
    present = [t for t in tensors if t is not None]
    return (bool(present) and all(type(t) is _Tensor for t in present)
            and len({id(t) for t in present}) == len(present)
            and not functools.reduce(_or, map(_data_ptr, present)) & 15)


class PlanCache:
    """A bounded LRU from launch key to plan, owned by one launcher module, with its most
    recent plans kept under guards in front of it (module docstring)."""

    def __init__(self, name: str, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"PlanCache {name!r}: capacity={capacity} must be >= 1")
        self.name = name
        self.capacity = capacity
        self._plans: OrderedDict = OrderedDict()
        self._recent: list[_Recent] = []
        self.hits = 0
        self.misses = 0
        _CACHES.add(self)

    def find(self, tensors: tuple, scalars: tuple = (), config=None, *,
             backend: Any = _NOT_GIVEN) -> tuple[Any, tuple | None]:
        """``(plan, None)`` for a call planned before, else ``(None, key)``: the launcher takes
        its full path and ``put(key, plan)``. ``tensors`` are the call's tensor arguments
        (``None`` allowed), ``scalars`` every other argument its plan depends on (``backend``
        among them), ``config`` its ``config`` argument. ``backend``, given, is the call's
        backend argument: a call that resolves to the torch path (which no plan serves) gets
        ``(None, None)`` without a key built, so the torch references pay no key per call."""
        # The call's head, flat: launch_state(), the scalars' types, the scalars, the config's
        # type and the config. Types come before values: a scalar of another type is never
        # compared by value (a tensor's == would not even give a bool).
        head = (autotune._GENERATION[0], id(_DRIVERS._active), *map(_ENV_GET, _STATE_KEYS),
                *map(type, scalars), *scalars, type(config), config)
        for entry in self._recent:
            if entry.head != head:
                continue
            for i in entry.nones:
                if tensors[i] is not None:
                    break
            else:
                present = entry.pick(tensors)
                if (entry.guard.check(*present)
                        and not functools.reduce(_or, map(_data_ptr, present)) & 15):
                    self.hits += 1
                    if entry is not self._recent[0]:
                        self._bump(entry)
                    return entry.plan, None
        if backend is not _NOT_GIVEN and _takes_torch(backend, tensors):
            self.misses += 1
            return None, None
        key = launch_key(tensors, scalars, config)
        plan = self.get(key)
        # (The head's state must be the key's: it is read twice, and another thread may have
        # changed a variable in between.)
        if (plan is not None and GUARDS is not None and head[:len(key[-1])] == key[-1]
                and _promotable(tensors)):
            self._recent.insert(0, _Recent(head, tensors, plan))
            del self._recent[RECENT:]
        return plan, (None if plan is not None else key)

    def _bump(self, entry) -> None:
        recent = self._recent
        try:
            recent.remove(entry)
        except ValueError:  # another thread moved it
            return
        recent.insert(0, entry)

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
            evicted = self._plans.popitem(last=False)[1]
            self._recent = [entry for entry in self._recent if entry.plan is not evicted]

    def clear(self) -> None:
        self._plans.clear()
        self._recent = []

    def __len__(self) -> int:
        return len(self._plans)

    def __repr__(self) -> str:
        return (f"PlanCache({self.name!r}, {len(self)}/{self.capacity} plans, "
                f"{self.hits} hits, {self.misses} misses)")


# Counts a CountPlan keeps launches for: the count tuples of a run's recent steps.
MAX_VARIANTS = 64


class CountPlan:
    """The plan of a launcher whose key holds its host counts by class (what picks its config
    and which launches run) rather than by value: one launch per tuple of counts, the first
    made by the full path, each other by ``vary(counts, tensors)`` (the launcher's checks of
    those counts against this call's tensors, which raise as the full path's do, then its
    first launch ``varied`` to their grid and values; None: take the full path) and kept, at
    most ``MAX_VARIANTS``. ``extra`` is the launcher's own (an output's shape, say)."""

    __slots__ = ("variants", "vary", "extra")

    def __init__(self, counts: tuple, launch: KernelLaunch, vary, extra=None):
        self.variants = {counts: launch}
        self.vary, self.extra = vary, extra

    @classmethod
    def first_axis(cls, count: int, launch: KernelLaunch, lowest: int, highest: int, *,
                   extra=None) -> "CountPlan":
        """The plan of a launch whose count is its grid's first axis and no argument: other
        counts vary that axis where ``lowest <= count <= highest`` (what the launcher's checks
        let through for its key); the full path decides any other."""
        def vary(other, tensors):
            if type(other) is int and lowest <= other <= highest:
                return launch.varied((other, *launch.grid[1:]))
            return None
        return cls(count, launch, vary, extra)

    @property
    def launches(self) -> tuple:
        return tuple(self.variants.values())

    def launch_for(self, counts: tuple, tensors: tuple) -> KernelLaunch | None:
        launch = self.variants.get(counts)
        if launch is None:
            launch = self.vary(counts, tensors)
            if launch is not None:
                if len(self.variants) >= MAX_VARIANTS:
                    self.variants.clear()
                self.variants[counts] = launch
        return launch


def count_class(count):
    """A count as a key part where it picks a config: its ``bucket_tokens`` (the next power
    of two, 0 kept apart) for a plain int >= 0, else itself (the full path decides)."""
    if type(count) is int and count >= 0:
        return 1 << (count - 1).bit_length() if count > 1 else count
    return count


def plan_caches() -> dict[str, PlanCache]:
    return {cache.name: cache for cache in _CACHES}


def clear_plans() -> None:
    """Forget every launcher's plans: the next calls take the full path and plan again."""
    for cache in list(_CACHES):
        cache.clear()
