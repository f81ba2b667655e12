"""Step overhead of the context, ours against megatron-core 0.16.1's, per decode step.

For each decode step at ``--requests`` active requests it counts, over the two calls the engine
makes per step (``initialize_attention_state`` before the forward pass, ``update_requests``
after it):

* **ops**: the torch operations that are not views, each a GPU launch (a kernel or a memcpy),
  seen by a ``TorchDispatchMode``. Views and aliases (every ATen op whose schema says it
  returns an alias of its input: view, slice, select, as_strided, alias, unsqueeze, squeeze,
  expand, t, transpose, permute, detach, split, unbind, the view half of reshape, lift_fresh)
  and ``_unsafe_view``, and allocations without a kernel (``empty*``), do not count. A call of
  one of our kernel launchers (a function of ``dynctx.kernels`` registered as a ``dynctx::``
  custom op), or of the custom op itself, counts as ONE op whatever runs inside (on a CPU the
  torch reference runs there; on a GPU one Triton launch, which the dispatcher cannot see).
* **syncs**: host-device synchronisations: ``_local_scalar_dense`` (``.item()``, ``int(t)``,
  ``bool(t)``, a 0-dim tensor used as an index), ``nonzero``, boolean-mask indexing
  (``index`` / ``index_put_`` with a bool or uint8 index), ``masked_select``, ``unique``,
  ``repeat_interleave`` without ``output_size``, ``equal`` / ``is_nonzero``, readbacks
  (``.tolist()``, ``.cpu()``, ``.to("cpu")``, ``.numpy()``, ``np.asarray(t)``, and
  ``torch.tensor(...)`` of data holding device tensors) of a DEVICE tensor, and blocking
  host-to-device copies: ``torch.tensor/as_tensor(python data, device=<device>)``, a
  ``copy_`` from a host tensor (not a 0-dim scalar) into a device tensor without
  ``non_blocking=True``, and any device op fed a host index tensor (an implicit H2D).
* **host time** per step (both calls), without the counting modes, and its ratio ours /
  megatron. On a CPU the "device" work runs inline, so this is host time plus the ops' own
  time: an upper bound of the host overhead of both sides. For ours it also splits off the time
  inside our kernel launchers (on a CPU the torch references; on a GPU the launches), and the
  summary holds the rest, **outside our kernels**, against megatron-core's whole host time:
  the target is at most ``TARGET_RATIO`` (0.25) with at most ``MAX_OPS`` ops and ``MAX_SYNCS``
  sync per step, reported pass/fail per size.

On a CPU device our context's arena is the host buffer itself, so the two arena uploads a CUDA
step makes (one per call, non-blocking) are not there to count: a CUDA step has two ops more
than the CPU count shows.

Which tensors are "device" and which "host". On CUDA: the tensor's device. On a CPU (where
both are CPU tensors) the counter tracks where each tensor would live: every tensor reachable
from the context when counting starts is a device tensor, except those whose memory belongs to
a numpy array reachable from it (host mirrors, ``torch.from_numpy``); a factory call
(``torch.tensor``, ``arange``, ``zeros``, ``full``, ...) makes a device tensor when it passes
``device=`` and a host tensor when it does not (a real CUDA program must name the device);
``torch.from_numpy`` makes a host tensor; every other op's output lives with its inputs
(device if any input is). Ops on host tensors only are host work: not counted. ``.cpu()`` of a
device tensor returns a host copy (as on CUDA).

Usage::

    python bench/step_overhead.py [--requests 16,64,256,1024] [--steps 50] [--json PATH]
    python bench/step_overhead.py --engine    # syncs per engine step instead

runs every size in one process (one torch thread by default) and prints a summary line per size
(``--tables`` adds each size's full table, ``--ops`` the per-op breakdown). The prompts spread
over [1, ``--max-prompt``], so requests fill their last block at different steps: at 256 and
1024 requests nearly every step has some (the pause-and-resume path of a block boundary).

As a function (tests): ``measure_step_overhead(requests=8, steps=4, ...)`` returns the same dict
that ``--json`` writes.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
# Under -P the script's own folder is not on sys.path; its sibling megatron_cpu is the peer.
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

import megatron_cpu as mo  # noqa: E402

aten = torch.ops.aten
GIB = 1024 ** 3

# --------------------------------------------------------------------------------------------
# The counter
# --------------------------------------------------------------------------------------------

#: Not launches although their schema does not mark an alias.
NOT_LAUNCHES = {
    aten._unsafe_view.default,
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten._local_scalar_dense.default,  # the readback itself: a sync, not a kernel
}
#: Ops that always sync (name prefix of the overload packet).
SYNC_PACKETS = {
    "nonzero": "nonzero",
    "masked_select": "masked_select",
    "unique_consecutive": "unique",
    "unique_dim": "unique",
    "_unique": "unique",
    "_unique2": "unique",
    "unique_dim_consecutive": "unique",
    "equal": "item",
    "is_nonzero": "item",
    "allclose": "item",
}

_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full,
    torch.empty, torch.randint, torch.rand, torch.randn, torch.linspace, torch.range,
    torch.eye, torch.empty_strided, torch.randperm, torch.scalar_tensor,
}
_LIKE_FACTORIES = {torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
                   torch.rand_like, torch.randn_like, torch.randint_like}
_READBACKS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__array__}


def _flat_tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _flat_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _flat_tensors(o, out)
    return out


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 (tensor subclasses without storage)
        return id(t)


def _is_device_arg(value, device: torch.device) -> Optional[bool]:
    """For a ``device=`` / ``.to()`` argument: True if it names ``device`` (type match),
    False if it names another device, None if it is not a device."""
    if isinstance(value, (str, torch.device)):
        try:
            return torch.device(value).type == device.type
        except (RuntimeError, TypeError):
            return None
    if isinstance(value, int) and not isinstance(value, bool):
        return device.type == "cuda"
    return None


class OverheadCounter:
    """Counts launches and syncs of everything run inside ``with counter.counting():``.

    ``device``: the context's device. ``roots``: objects (the context) whose reachable tensors
    are the initial device state and whose reachable numpy arrays are host memory (CPU only).
    ``launcher_modules``: modules whose globals that are ``dynctx.kernels`` launchers are
    wrapped, for the duration, to count as one op each.
    """

    def __init__(self, device, *, roots=(), launcher_modules=(), device_roots=None,
                 host_tensors=(), device_tensors=()):
        self.device = torch.device(device)
        self.emulate = self.device.type != "cuda"
        # With ``device_roots`` (CPU emulation of an engine step): the tensors reachable from
        # them are the device's, and every other tensor that exists when counting starts is
        # host memory (prompts, read-back buffers, ``torch.from_numpy`` arrays).
        self._unknown_host = device_roots is not None
        self._device_made: List[weakref.ref] = []
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.sync_ops: Counter = Counter()  # (kind, op) -> count, for the report
        self._loc: Dict[int, bool] = {}  # storage key -> is_host (CPU emulation)
        self._host_ranges: List[tuple] = []
        self._pending: List[bool] = []
        self._suppress = 0
        self._launcher_modules = list(launcher_modules)
        for root in roots:
            self._scan(root)
        seen: set = set()
        found: List[torch.Tensor] = []
        for root in device_roots or ():
            self._scan(root, seen=seen, found=found)
        self._host_ranges.sort()
        self._starts = [r[0] for r in self._host_ranges]
        for tensor in found:
            # Tensors over numpy memory (the context's host mirrors; on a CPU its arena) stay
            # host, as they are under ``roots``.
            if self.emulate and not self._in_host_range(_storage_key(tensor)):
                self._loc[_storage_key(tensor)] = False
        for tensor in device_tensors:
            if self.emulate:
                self._loc[_storage_key(tensor)] = False
                self._device_made.append(weakref.ref(tensor))
        for tensor in host_tensors:
            if self.emulate and isinstance(tensor, torch.Tensor):
                self._loc[_storage_key(tensor)] = True

    # ---------------------------------------------------------------- bookkeeping
    def _scan(self, root, depth=0, seen=None, found=None):
        seen = set() if seen is None else seen
        if id(root) in seen or depth > (6 if found is None else 12):
            return
        seen.add(id(root))
        if isinstance(root, np.ndarray):
            base = root
            while isinstance(base.base, np.ndarray):
                base = base.base
            ptr = base.__array_interface__["data"][0]
            self._host_ranges.append((ptr, ptr + max(base.nbytes, 1)))
            return
        if isinstance(root, torch.Tensor):
            if found is not None:
                found.append(root)
            return
        if isinstance(root, dict):
            items = list(root.values())
        elif isinstance(root, (list, tuple, set)):
            items = list(root)
        elif isinstance(root, types.SimpleNamespace) or (
            hasattr(root, "__dict__")
            and type(root).__module__.split(".")[0] in ("dynctx", "megatron", "context")
        ):
            items = list(vars(root).values())
        else:
            return
        for item in items:
            self._scan(item, depth + 1, seen, found)

    def is_host(self, t: torch.Tensor) -> bool:
        if not self.emulate:
            return t.device.type != "cuda"
        key = _storage_key(t)
        loc = self._loc.get(key)
        if loc is not None:
            return loc
        return self._in_host_range(key) or self._unknown_host

    def _in_host_range(self, key: int) -> bool:
        i = bisect.bisect_right(self._starts, key) - 1
        return i >= 0 and key < self._host_ranges[i][1]

    def _mark(self, out, host: bool, keep=()):
        if not self.emulate:
            return
        keep_keys = {_storage_key(t) for t in keep}
        for t in _flat_tensors(out, []):
            key = _storage_key(t)
            if key not in keep_keys:
                self._loc[key] = host
                if not host and self._unknown_host:
                    self._device_made.append(weakref.ref(t))

    def device_made(self) -> List[weakref.ref]:
        """Weak references to the device tensors made while counting (with ``device_roots``),
        and to those it was given: the live ones are what a counter of the next step gets as
        ``device_tensors``, so that a device tensor kept from one step to the next stays one."""
        return list(self._device_made)

    def _mark_launch(self, out, args, kwargs):
        """With ``device_roots``: a launch's new outputs live where its inputs do (device if
        any input is); without, unmarked outputs are device already."""
        if self._unknown_host:
            ins = _flat_tensors(args, []) + _flat_tensors(kwargs, [])
            self._mark(out, all(self.is_host(t) for t in ins), keep=ins)

    def count_op(self, name: str, n: int = 1):
        self.ops[name] += n

    def count_sync(self, kind: str, op: str):
        self.syncs[kind] += 1
        self.sync_ops[(kind, op)] += 1

    @contextlib.contextmanager
    def suppressed(self):
        self._suppress += 1
        try:
            yield
        finally:
            self._suppress -= 1

    def reset(self):
        self.ops.clear()
        self.syncs.clear()
        self.sync_ops.clear()

    # ---------------------------------------------------------------- launchers
    def _wrap_launcher(self, fn: Callable) -> Callable:
        counter = self
        name = f"dynctx::{fn.__name__}"

        def launcher(*args, **kwargs):
            if counter._suppress:
                return fn(*args, **kwargs)
            counter.count_op(name)
            with counter.suppressed():
                out = fn(*args, **kwargs)
            counter._mark_launch(out, args, kwargs)
            return out

        launcher.__wrapped__ = fn
        return launcher

    @contextlib.contextmanager
    def _launchers_wrapped(self):
        saved = []
        try:
            for module in self._launcher_modules:
                for attr, value in list(vars(module).items()):
                    if (isinstance(value, types.FunctionType)
                            and getattr(value, "__module__", "").startswith("dynctx.kernels")
                            and not attr.startswith("_")
                            and _is_registered_op(value.__name__)):
                        saved.append((module, attr, value))
                        setattr(module, attr, self._wrap_launcher(value))
            yield
        finally:
            for module, attr, value in saved:
                setattr(module, attr, value)

    @contextlib.contextmanager
    def counting(self):
        with self._launchers_wrapped(), _FunctionMode(self), _DispatchMode(self):
            yield self


def _is_registered_op(name: str) -> bool:
    try:
        getattr(torch.ops.dynctx, name)
        return True
    except (AttributeError, RuntimeError):
        return False


class _FunctionMode(TorchFunctionMode):
    def __init__(self, counter: OverheadCounter):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c._suppress:
            return func(*args, **kwargs)
        if func in _FACTORIES:
            dev = kwargs.get("device")
            on_device = _is_device_arg(dev, c.device) if dev is not None else False
            host = not on_device
            if func in (torch.tensor, torch.as_tensor) and args:
                data = args[0]
                inner = _flat_tensors(data, []) if not isinstance(data, torch.Tensor) else []
                if any(not c.is_host(t) for t in inner):
                    c.count_sync("readback", f"torch.{func.__name__}(device tensors)")
                if isinstance(data, torch.Tensor):
                    # as_tensor / tensor of an existing tensor: a move or a copy.
                    src_host = c.is_host(data)
                    if dev is None:
                        host = src_host
                    elif on_device and src_host and data.dim() > 0:
                        c.count_sync("blocking_h2d", f"torch.{func.__name__}")
                        c.count_op(f"h2d:torch.{func.__name__}")
                elif on_device:
                    c.count_sync("blocking_h2d", f"torch.{func.__name__}")
                    c.count_op(f"h2d:torch.{func.__name__}")
            c._pending.append(host)
            try:
                out = func(*args, **kwargs)
            finally:
                c._pending.pop()
            c._mark(out, host)
            return out
        if func in _LIKE_FACTORIES and "device" in kwargs:
            on_device = _is_device_arg(kwargs["device"], c.device)
            c._pending.append(not on_device)
            try:
                out = func(*args, **kwargs)
            finally:
                c._pending.pop()
            c._mark(out, not on_device)
            return out
        if func is torch.Tensor.to or func in _READBACKS:
            t = args[0] if args else None
            if not isinstance(t, torch.Tensor):
                return func(*args, **kwargs)
            direction = None
            if func in _READBACKS:
                direction = None if c.is_host(t) else "d2h"
            else:
                target = kwargs.get("device")
                for a in args[1:]:
                    if isinstance(a, torch.Tensor):
                        target = torch.device("cpu") if c.is_host(a) else c.device
                    elif _is_device_arg(a, c.device) is not None:
                        target = a
                if target is not None:
                    if c.emulate:
                        # Both sides are CPU tensors: a move of a device tensor is a readback,
                        # a move of a host tensor an upload.
                        direction = "h2d" if c.is_host(t) else "d2h"
                    else:
                        to_cuda = torch.device(target).type == "cuda" if not isinstance(
                            target, int) else True
                        if t.is_cuda and not to_cuda:
                            direction = "d2h"
                        elif not t.is_cuda and to_cuda:
                            direction = "h2d"
            if direction is None:
                return func(*args, **kwargs)
            name = f"Tensor.{getattr(func, '__name__', func)}"
            if direction == "d2h":
                c.count_sync("readback", name)
            else:
                c.count_op(f"h2d:{name}")
                if t.dim() > 0 and not kwargs.get("non_blocking", False):
                    c.count_sync("blocking_h2d", name)
            with c.suppressed():
                out = func(*args, **kwargs)
                if c.emulate and isinstance(out, torch.Tensor) and (
                        _storage_key(out) == _storage_key(t)):
                    out = out.clone()  # on CUDA this is a copy, not an alias
            c._mark(out, direction == "d2h")
            return out
        return func(*args, **kwargs)


class _DispatchMode(TorchDispatchMode):
    def __init__(self, counter: OverheadCounter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c._suppress:
            return func(*args, **kwargs)
        if func.namespace == "dynctx":
            c.count_op(f"dynctx::{func._opname}")
            with c.suppressed():
                out = func(*args, **kwargs)
            c._mark_launch(out, args, kwargs)
            return out
        ins = _flat_tensors(args, []) + _flat_tensors(kwargs, [])
        dev_in = [t for t in ins if not c.is_host(t)]
        out = func(*args, **kwargs)
        packet = func._opname
        # Where the outputs live.
        if func is aten.lift_fresh.default:
            host = c._pending[-1] if c._pending else True
            c._mark(out, host)
            return out
        if ins:
            host = not dev_in
        else:
            host = c._pending[-1] if c._pending else False
        if func.is_view or _returns_alias(func):
            c._mark(out, host, keep=ins)
        else:
            c._mark(out, host, keep=ins if _mutates(func) else ())
        if not dev_in and not (not ins and not host):
            return out  # host work
        name = f"aten::{packet}"
        if func is aten._local_scalar_dense.default:
            c.count_sync("item", name)
            return out
        if func.is_view or func in NOT_LAUNCHES:
            return out
        c.count_op(name)
        kind = SYNC_PACKETS.get(packet)
        if kind:
            c.count_sync(kind, name)
        if packet in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            for idx in indices or []:
                if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                    c.count_sync("bool_mask_index", name)
                    break
        if packet == "repeat_interleave" and func.overloadpacket is aten.repeat_interleave \
                and kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None) \
                and isinstance(args[0], torch.Tensor) and "Tensor" in str(func._overloadname):
            c.count_sync("repeat_interleave", name)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            dst_host, src_host = c.is_host(dst), c.is_host(src)
            if not dst_host and src_host and src.dim() > 0:
                if not non_blocking:
                    c.count_sync("blocking_h2d", name)
            elif dst_host and not src_host:
                # A non-blocking copy into pinned memory (in the CPU emulation: any host
                # buffer) does not wait: the host waits on its event when it reads the buffer.
                if not (non_blocking and (c.emulate or dst.is_pinned())):
                    c.count_sync("readback", name)
            return out
        if func is aten._to_copy.default and not c.emulate:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == "cpu" and dev_in:
                c.count_sync("readback", name)
            return out
        # A device op fed a host tensor (other than a 0-dim scalar): an implicit H2D copy.
        if any(c.is_host(t) and t.dim() > 0 for t in ins):
            c.count_sync("blocking_h2d", name)
        return out


def _returns_alias(func) -> bool:
    try:
        rets = func._schema.returns
    except AttributeError:
        return False
    return bool(rets) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in rets
    )


def _mutates(func) -> bool:
    try:
        return any(a.alias_info is not None and a.alias_info.is_write
                   for a in func._schema.arguments)
    except AttributeError:
        return False


# --------------------------------------------------------------------------------------------
# The workload: prefill N requests, then measure decode steps
# --------------------------------------------------------------------------------------------


def prefill_steps(prompts: List[int], max_tokens: int) -> List[int]:
    """The step at which ``_prefill`` adds each prompt (it packs prompts in order while the
    step's tokens, one per request already added and the new prompts, fit ``max_tokens``)."""
    added, step, at, tokens = 0, 0, [], 0
    for p in prompts:
        if tokens and tokens + p > max_tokens:
            step, tokens = step + 1, added
        at.append(step)
        tokens += p
        added += 1
    return at


def bench_config(*, requests: int, steps: int, block_size: int, max_prompt: int,
                 max_tokens: int, params_dtype=torch.float16) -> dict:
    """Enough blocks for every request to grow through the rest of the prefill steps and then
    ``steps + 2`` tokens without real pausing (a request that fills its block is paused and
    resumed in the same update, the normal block-boundary path), an explicit paused budget of
    8 blocks on both sides."""
    prompts = prompt_lengths(requests, max_prompt)
    max_tokens = max(max_tokens, requests)
    at = prefill_steps(prompts, max_tokens)
    last = at[-1] if at else 0
    need = sum(math.ceil((p + (last - a) + steps + 2) / block_size) for p, a in zip(prompts, at))
    shape = dict(params_dtype=params_dtype, num_layers=2, kv_channels=64, num_attention_heads=2,
                 block_size_tokens=block_size)
    bb = mo.block_size_bytes(**shape)
    paused = 8
    total = need + paused + 8
    max_seq = block_size * math.ceil((max_prompt + last + steps + 4) / block_size)
    return dict(
        shape,
        max_sequence_length=max_seq,
        buffer_size_gb=total * bb / 1024**3,
        paused_buffer_size_gb=paused * bb / 1024**3,
        max_requests=requests,
        max_tokens=max_tokens,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        unified_memory_level=0,
    )


def prompt_lengths(requests: int, max_prompt: int) -> List[int]:
    """Deterministic, spread over [1, max_prompt] so that requests cross block boundaries at
    different steps."""
    return [1 + (i * 97 + 31) % max_prompt for i in range(requests)]


# Options only our side takes (megatron-core 0.16.1 has no prefix cache: its side runs without).
OURS_ONLY = ("enable_prefix_caching",)


def _make_context(kind: str, cfg: dict, device):
    if kind == "ours":
        from dynctx.context import DynamicInferenceContext

        return DynamicInferenceContext(**cfg, device=device)
    cfg = {k: v for k, v in cfg.items() if k not in OURS_ONLY}
    if torch.device(device).type == "cpu":
        return mo.make_megatron_context(**cfg).raw
    mdc, _, _ = mo.import_megatron()
    ctx = mdc.DynamicInferenceContext(**cfg)
    ctx.reset()
    return ctx


def _factory(kind: str):
    if kind == "ours":
        from dynctx.context import DynamicInferenceRequest, SamplingParams

        return mo.make_request_factory(DynamicInferenceRequest, SamplingParams)
    _, mir, msp = mo.import_megatron()
    return mo.make_request_factory(mir.DynamicInferenceRequest, msp.SamplingParams)


def _held(kind: str, device):
    if kind == "megatron" and torch.device(device).type == "cpu":
        return mo.megatron_on_cpu()
    return contextlib.nullcontext()


def _prefill(ctx, kind: str, cfg: dict, requests: int, steps: int, max_prompt: int, device):
    factory = _factory(kind)
    pending = list(enumerate(prompt_lengths(requests, max_prompt)))
    step = 0
    while pending:
        while pending and ctx.active_token_count + pending[0][1] <= ctx.max_tokens:
            rid, p = pending.pop(0)
            prompt = (torch.arange(p, dtype=torch.long) * 104729 + rid * 7919 + 13) % 32000
            ctx.add_request(factory(rid, prompt, steps + 8))
        ctx.initialize_attention_state()
        a = ctx.total_request_count - ctx.paused_request_count
        ctx.update_requests(torch.ones(a, dtype=torch.uint8, device=device),
                            torch.arange(a, dtype=torch.long, device=device) + 100 * step)
        step += 1
    assert ctx.total_request_count == requests and ctx.paused_request_count == 0, (
        "the benchmark buffer is too small: requests are paused after prefill")


def _step_inputs(n: int, steps: int, device):
    masks = [torch.ones(n, dtype=torch.uint8, device=device) for _ in range(steps)]
    tokens = [torch.arange(n, dtype=torch.long, device=device) * 7 + s for s in range(steps)]
    return masks, tokens


def _context_modules() -> list:
    """The modules of our context whose globals hold the kernel launchers it calls."""
    import importlib
    import pkgutil

    import dynctx.context

    return [importlib.import_module(f"dynctx.context.{info.name}")
            for info in pkgutil.iter_modules(dynctx.context.__path__)]


def _count_run(kind: str, cfg: dict, *, requests: int, steps: int, max_prompt: int, device):
    """Per-step op and sync counts (counting modes on) for one side."""

    with _held(kind, device):
        ctx = _make_context(kind, cfg, device)
        _prefill(ctx, kind, cfg, requests, steps, max_prompt, device)
        masks, tokens = _step_inputs(requests, steps, device)
        counter = OverheadCounter(device, roots=[ctx],
                                  launcher_modules=_context_modules() if kind == "ours" else [])
        per_step = []
        for s in range(steps):
            crossing = _crossing(ctx)
            step_rec = {"crossing": crossing}
            for call in ("initialize_attention_state", "update_requests"):
                counter.reset()
                with counter.counting():
                    if call == "initialize_attention_state":
                        ctx.initialize_attention_state()
                    else:
                        ctx.update_requests(masks[s], tokens[s])
                step_rec[call] = {"ops": sum(counter.ops.values()),
                                  "syncs": sum(counter.syncs.values()),
                                  "op_counts": dict(counter.ops),
                                  "sync_counts": dict(counter.syncs),
                                  "sync_ops": {f"{k}:{o}": v
                                               for (k, o), v in counter.sync_ops.items()}}
            assert ctx.total_request_count - ctx.paused_request_count == requests
            per_step.append(step_rec)
    return per_step


def _engine_modules() -> list:
    """The engine's modules whose globals hold kernel launchers (counted as one op each)."""
    import importlib
    import pkgutil

    import dynctx.engine

    return [importlib.import_module(f"dynctx.engine.{info.name}")
            for info in pkgutil.iter_modules(dynctx.engine.__path__)]


@contextlib.contextmanager
def _uncounted_forward(counter: OverheadCounter, owner, name: str, launched: list):
    """``owner.<name>`` (the model's forward, a graph runner's replay) runs uncounted for the
    duration, its outputs marked as device tensors, and ``launched`` notes that it ran: the
    model's own reads are the model's business (the torch attention path reads lengths by
    design); the engine's are counted."""
    if owner is None:
        yield
        return
    original = getattr(owner, name)
    own = name in vars(owner)

    def run(*args, **kwargs):
        with counter.suppressed():
            out = original(*args, **kwargs)
        counter._mark(out, False)
        launched.append(name)
        return out

    setattr(owner, name, run)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def _readback_waits(counter: OverheadCounter, launched: list):
    """Async scheduling's reads of a copy to the host (``TokenReadback.read``, a wait on the
    copy's event): one after the step's forward was launched leaves the device busy (not a
    sync); one before it, or in a step without a forward, waits for the device (a sync)."""
    from dynctx.engine.overlap import TokenReadback

    original = TokenReadback.read

    def read(self, handle):
        if not launched:
            counter.count_sync("readback_wait", "TokenReadback.read before the forward")
        return original(self, handle)

    TokenReadback.read = read
    try:
        yield
    finally:
        TokenReadback.read = original


def count_engine_steps(engine, steps: int) -> List[dict]:
    """The ops and syncs of up to ``steps`` calls of ``engine.step()`` outside the model's
    forward (admission, sampling, the finish mask, the context's calls and the engine's
    bookkeeping), one dict per step: ``{"step", "idle", "replayed", "ops", "syncs",
    "sync_counts", "sync_sites"}`` (``replayed``: graphs the step replayed). Stops early once
    the engine has nothing left to do.

    What is "device" (CPU emulation): what the context holds, as for the context's own count
    (but for the id lists an update returns, CPU tensors on every device), the model's logits,
    and what is computed from them; every other tensor that exists when a step starts is host
    memory (prompts, the engine's read-back buffers, ``torch.from_numpy`` arrays); a device
    tensor made in one step and still alive in the next stays one. A non-blocking copy from
    the device into host memory is not a sync (on CUDA, into pinned memory); the wait on its
    event when the host reads it is one unless the step's forward was launched before
    (``_readback_waits``)."""
    per_step = []
    carried: List[weakref.ref] = []
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        ctx = engine.context
        # The id lists an update hands back are CPU tensors on every device.
        host = [getattr(ctx, name, None) for name in (
            "newly_paused_request_ids", "evicted_request_ids", "max_length_finished_request_ids")]
        counter = OverheadCounter(ctx.device, roots=[ctx], device_roots=[ctx], host_tensors=host,
                                  device_tensors=[t for t in (r() for r in carried)
                                                  if t is not None],
                                  launcher_modules=_context_modules() + _engine_modules())
        launched: List[str] = []
        runner = engine.graph_runner
        replays_before = 0 if runner is None else sum(runner.replays.values())
        with _uncounted_forward(counter, engine.model, "forward", launched), \
                _uncounted_forward(counter, engine.graph_runner, "run", launched), \
                _readback_waits(counter, launched), counter.counting():
            result = engine.step()
        carried = [r for r in counter.device_made() if r() is not None]
        replayed = 0 if runner is None else sum(runner.replays.values()) - replays_before
        per_step.append({"step": result.step, "idle": result.idle, "replayed": replayed,
                         "ops": sum(counter.ops.values()),
                         "syncs": sum(counter.syncs.values()),
                         "sync_counts": dict(counter.syncs),
                         "sync_sites": {f"{k}:{o}": v for (k, o), v in counter.sync_ops.items()}})
    return per_step


# The engine modes ``engine_syncs`` counts: eager and CUDA graphs, synchronous and async.
ENGINE_MODES = ("sync", "graphs", "async", "graphs_async")


def engine_syncs(requests: int = 8, new_tokens: int = 12) -> Dict[str, List[dict]]:
    """``count_engine_steps`` over a tiny random Llama (fp32, CPU emulation), prompts of 3-40
    tokens (chunked prefill), greedy and seeded temperature/top-k/top-p rows, in each of
    ``ENGINE_MODES``: eager, CUDA graphs (on a CPU the stand-in runner, whose replay is not
    counted, as an eager forward is not), and both with async scheduling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dynctx.context import DynamicInferenceRequest, SamplingParams
    from dynctx.engine import Engine

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128))
    out = {}
    for mode in ENGINE_MODES:
        engine = Engine.from_transformers(hf.eval(), block_size_tokens=16, max_tokens=32,
                                          buffer_size_gb=64 * 16 * 2 * 2 * 2 * 16 * 4 / GIB,
                                          paused_buffer_size_gb=4 * 16 * 2 * 2 * 2 * 16 * 4 / GIB,
                                          kernel_backend="torch",
                                          num_cuda_graphs=4 if "graphs" in mode else None,
                                          async_scheduling=mode.endswith("async"))
        for i in range(requests):
            params = SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8, top_k=4 * (i % 2),
                                    top_p=0.9 if i % 4 == 3 else 0.0, seed=i,
                                    num_tokens_to_generate=new_tokens)
            prompt = [(7 * i + 3 * j) % 256 for j in range(3 + (i * 11) % 38)]
            engine.add_request(DynamicInferenceRequest(request_id=i, prompt_tokens=prompt,
                                                       sampling_params=params), i // 2)
        out[mode] = count_engine_steps(engine, 1000)
    return out


def format_engine_syncs(runs: Dict[str, List[dict]]) -> str:
    lines = ["syncs per engine step outside the model's forward (CPU emulation; tiny Llama)"]
    for mode, steps in runs.items():
        forwards = [s for s in steps if not s["idle"]]
        sites: Counter = Counter()
        for s in steps:
            sites.update(s["sync_sites"])
        replays = sum(s.get("replayed", 0) for s in steps)
        lines.append(f"  {mode:12s}: {len(forwards)} forward steps ({replays} replayed), "
                     f"syncs per forward step max {max(s['syncs'] for s in forwards)}, total "
                     f"{sum(s['syncs'] for s in forwards)}; idle steps {len(steps) - len(forwards)}"
                     f" with {sum(s['syncs'] for s in steps if s['idle'])}; sites "
                     f"{dict(sites) or '{}'}")
    return "\n".join(lines)


def _crossing(ctx) -> int:
    """How many active requests fill their last block in this step (pause + resume path); read
    outside the counting, through the public tensors of either side."""
    paused, total = ctx.paused_request_count, ctx.total_request_count
    offsets = ctx.request_last_kv_block_offset[paused:total].cpu().numpy()
    return int((offsets == ctx.block_size_tokens - 1).sum())


@contextlib.contextmanager
def _launcher_timer(modules, sink: List[float]):
    """Wrap the dynctx launchers of ``modules`` to add their wall time to ``sink[0]``."""
    saved = []

    def wrap(fn):
        def launcher(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sink[0] += time.perf_counter() - t0

        return launcher

    try:
        for module in modules:
            for attr, value in list(vars(module).items()):
                if (isinstance(value, types.FunctionType)
                        and getattr(value, "__module__", "").startswith("dynctx.kernels")
                        and not attr.startswith("_") and _is_registered_op(value.__name__)):
                    saved.append((module, attr, value))
                    setattr(module, attr, wrap(value))
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _time_run(kind: str, cfg: dict, *, requests: int, steps: int, max_prompt: int, device,
              repeats: int):
    """Host seconds per step (both calls), the best of ``repeats`` runs, per step; and for ours
    the seconds spent inside kernel launchers (on a CPU: the torch references)."""
    best = None
    best_in_launchers = None
    cuda = torch.device(device).type == "cuda"
    with _held(kind, device):
        for _ in range(repeats):
            ctx = _make_context(kind, cfg, device)
            _prefill(ctx, kind, cfg, requests, steps, max_prompt, device)
            masks, tokens = _step_inputs(requests, steps, device)
            if cuda:
                torch.cuda.synchronize()
            times, in_launchers = [], []
            sink = [0.0]
            gc_was = gc.isenabled()
            gc.disable()
            timer = _launcher_timer(_context_modules() if kind == "ours" else [], sink)
            try:
                with timer:
                    for s in range(steps):
                        sink[0] = 0.0
                        t0 = time.perf_counter()
                        ctx.initialize_attention_state()
                        ctx.update_requests(masks[s], tokens[s])
                        if cuda:
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                        in_launchers.append(sink[0])
            finally:
                if gc_was:
                    gc.enable()
            if best is None:
                best, best_in_launchers = times, in_launchers
            else:
                pick = [t < b for t, b in zip(times, best)]
                best = [t if p else b for t, b, p in zip(times, best, pick)]
                best_in_launchers = [t if p else b
                                     for t, b, p in zip(in_launchers, best_in_launchers, pick)]
    return best, best_in_launchers


def _summary(values: List[float]) -> dict:
    if not values:
        return {}
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "min": min(values), "max": max(values)}


def _side_summary(per_step, times) -> dict:
    def col(call, key):
        return [s[call][key] for s in per_step]

    total_ops = [s["initialize_attention_state"]["ops"] + s["update_requests"]["ops"]
                 for s in per_step]
    total_syncs = [s["initialize_attention_state"]["syncs"] + s["update_requests"]["syncs"]
                   for s in per_step]
    steady = [i for i, s in enumerate(per_step) if s["crossing"] == 0]
    crossing = [i for i, s in enumerate(per_step) if s["crossing"] > 0]
    sync_kinds: Counter = Counter()
    op_names: Counter = Counter()
    sync_ops: Counter = Counter()
    for s in per_step:
        for call in ("initialize_attention_state", "update_requests"):
            sync_kinds.update(s[call]["sync_counts"])
            op_names.update({f"{call}/{k}": v for k, v in s[call]["op_counts"].items()})
            sync_ops.update({f"{call}/{k}": v for k, v in s[call]["sync_ops"].items()})
    n = len(per_step)
    return {
        "ops": _summary(total_ops),
        "syncs": _summary(total_syncs),
        "ops_steady": _summary([total_ops[i] for i in steady]),
        "syncs_steady": _summary([total_syncs[i] for i in steady]),
        "ops_crossing": _summary([total_ops[i] for i in crossing]),
        "syncs_crossing": _summary([total_syncs[i] for i in crossing]),
        "steps_steady": len(steady),
        "steps_crossing": len(crossing),
        "per_call": {call: {"ops": _summary(col(call, "ops")),
                            "syncs": _summary(col(call, "syncs"))}
                     for call in ("initialize_attention_state", "update_requests")},
        "sync_kinds_per_step": {k: v / n for k, v in sorted(sync_kinds.items())},
        "op_names_per_step": {k: v / n for k, v in sorted(op_names.items())},
        "sync_sites_per_step": {k: v / n for k, v in sorted(sync_ops.items())},
        "host_seconds_per_step": _summary(times),
        "per_step": [
            {"crossing": s["crossing"], "ops": total_ops[i], "syncs": total_syncs[i],
             "host_seconds": times[i] if i < len(times) else None}
            for i, s in enumerate(per_step)
        ],
    }


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "platform": platform.platform()}
    try:
        from importlib.metadata import version

        out["megatron-core"] = version("megatron-core")
    except Exception:  # noqa: BLE001
        out["megatron-core"] = None
    try:
        out["git_revision"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except Exception:  # noqa: BLE001
        out["git_revision"] = None
    return out


def measure_step_overhead(*, requests: int = 64, steps: int = 50, block_size: int = 256,
                          max_prompt: int = 512, max_tokens: int = 16384,
                          device: str = "cpu", repeats: int = 3,
                          sides=("megatron", "ours"), threads: Optional[int] = 1,
                          prefix_caching: bool = False) -> dict:
    """Count and time ``initialize_attention_state`` + ``update_requests`` per decode step for
    each side; returns a JSON-ready dict (see the module docstring).

    ``threads``: torch intra-op threads during the run (restored after; None leaves them). One
    by default: the ops are tiny, and on a busy machine intra-op thread pools add milliseconds
    of barrier waits to single ops (seen: ``repeat_interleave`` of 64 elements taking 10-20 ms
    with 2 threads on a loaded 2-core box), which would swamp the host-time comparison.
    ``prefix_caching``: our context with ``enable_prefix_caching`` (Megatron's side without).
    """
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _measure(requests=requests, steps=steps, block_size=block_size,
                        max_prompt=max_prompt, max_tokens=max_tokens, device=device,
                        repeats=repeats, sides=sides, threads=torch.get_num_threads(),
                        prefix_caching=prefix_caching)
    finally:
        torch.set_num_threads(saved_threads)


def _measure(*, requests, steps, block_size, max_prompt, max_tokens, device, repeats, sides,
             threads, prefix_caching=False) -> dict:
    cfg = bench_config(requests=requests, steps=steps, block_size=block_size,
                       max_prompt=max_prompt, max_tokens=max_tokens)
    if prefix_caching:
        cfg["enable_prefix_caching"] = True
    result: Dict[str, Any] = {
        "benchmark": "step_overhead",
        "calls": ["initialize_attention_state", "update_requests"],
        "requests": requests, "steps": steps, "block_size": block_size,
        "max_prompt": max_prompt, "device": str(device), "torch_threads": threads,
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in cfg.items()},
        "versions": _versions(),
        "sides": {},
    }
    for side in sides:
        per_step = _count_run(side, cfg, requests=requests, steps=steps, max_prompt=max_prompt,
                              device=device)
        times, in_launchers = _time_run(side, cfg, requests=requests, steps=steps,
                                        max_prompt=max_prompt, device=device, repeats=repeats)
        result["sides"][side] = _side_summary(per_step, times)
        result["sides"][side]["host_seconds_in_launchers_per_step"] = _summary(in_launchers)
        result["sides"][side]["host_seconds_outside_launchers_per_step"] = _summary(
            [t - i for t, i in zip(times, in_launchers)])
    if "ours" in result["sides"] and "megatron" in result["sides"]:
        o, m = result["sides"]["ours"], result["sides"]["megatron"]
        result["host_time_ratio_ours_over_megatron"] = (
            o["host_seconds_per_step"]["median"] / m["host_seconds_per_step"]["median"])
    return result


def format_table(result: dict) -> str:
    sides = list(result["sides"])
    names = {"megatron": "megatron-core 0.16.1", "ours": "dynctx"}
    rows = []

    def add(label, fn):
        rows.append([label] + [fn(result["sides"][s]) for s in sides])

    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    add("ops / step (mean)", lambda s: f(s["ops"].get("mean")))
    add("  min .. max", lambda s: f"{s['ops'].get('min', 0)} .. {s['ops'].get('max', 0)}")
    add("  steady steps (no block filled)", lambda s: f(s["ops_steady"].get("mean")))
    add("  steps where a block fills", lambda s: f(s["ops_crossing"].get("mean")))
    for call in ("initialize_attention_state", "update_requests"):
        add(f"  {call}", lambda s, call=call: f(s["per_call"][call]["ops"]["mean"]))
    add("syncs / step (mean)", lambda s: f(s["syncs"].get("mean")))
    add("  steady steps", lambda s: f(s["syncs_steady"].get("mean")))
    add("  steps where a block fills", lambda s: f(s["syncs_crossing"].get("mean")))
    kinds = sorted({k for s in result["sides"].values() for k in s["sync_kinds_per_step"]})
    for k in kinds:
        add(f"  {k}", lambda s, k=k: f(s["sync_kinds_per_step"].get(k, 0.0), 2))
    add("host us / step (median)", lambda s: f(s["host_seconds_per_step"]["median"] * 1e6))
    add("  of which inside dynctx launchers", lambda s: f(
        s["host_seconds_in_launchers_per_step"]["median"] * 1e6))
    widths = [max(len(str(r[i])) for r in rows + [["", *[names.get(s, s) for s in sides]]])
              for i in range(len(sides) + 1)]
    head = ["", *[names.get(s, s) for s in sides]]
    lines = [
        f"step overhead: initialize_attention_state + update_requests per decode step, "
        f"{result['requests']} requests, {result['steps']} steps, block {result['block_size']}, "
        f"device {result['device']}",
        "  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                  for i, (h, w) in enumerate(zip(head, widths))),
    ]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
    if "host_time_ratio_ours_over_megatron" in result:
        lines.append(f"host time ratio ours / megatron: "
                     f"{result['host_time_ratio_ours_over_megatron']:.2f}")
    return "\n".join(lines)


#: The host-time target: ours, outside our kernels, at most this fraction of megatron-core's
#: host time for the same step (docs/DESIGN.md, Performance); and the launch and sync budgets.
TARGET_RATIO = 0.25
MAX_OPS = 6
MAX_SYNCS = 1
SIZES = (16, 64, 256, 1024)


def summary_row(result: dict) -> dict:
    """One size's line of the summary: medians per step in µs, the ratio of our host time
    outside our kernels to megatron-core's, the most ops and syncs of any step, and whether
    the targets hold (ratio <= TARGET_RATIO, ops <= MAX_OPS, syncs <= MAX_SYNCS)."""
    ours = result["sides"]["ours"]
    row = {"requests": result["requests"],
           "ours_us": ours["host_seconds_per_step"]["median"] * 1e6,
           "inside_us": ours["host_seconds_in_launchers_per_step"]["median"] * 1e6,
           "outside_us": ours["host_seconds_outside_launchers_per_step"]["median"] * 1e6,
           "ops": ours["ops"]["max"], "syncs": ours["syncs"]["max"],
           "steps_crossing": ours["steps_crossing"], "steps": result["steps"]}
    megatron = result["sides"].get("megatron")
    row["megatron_us"] = megatron["host_seconds_per_step"]["median"] * 1e6 if megatron else None
    row["ratio"] = row["outside_us"] / row["megatron_us"] if megatron else None
    row["pass"] = (row["ratio"] is not None and row["ratio"] <= TARGET_RATIO
                   and row["ops"] <= MAX_OPS and row["syncs"] <= MAX_SYNCS)
    return row


def format_summary(rows: List[dict], *, threads: int, load: Optional[tuple]) -> str:
    head = ("requests", "megatron us", "ours us", "in kernels", "outside", "outside/megatron",
            "ops", "syncs", "crossing steps", f"<= {TARGET_RATIO}x, ops <= {MAX_OPS}, "
            f"syncs <= {MAX_SYNCS}")

    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    lines = [[str(r["requests"]), f(r["megatron_us"]), f(r["ours_us"]), f(r["inside_us"]),
              f(r["outside_us"]), f(r["ratio"], 3), str(r["ops"]), str(r["syncs"]),
              f"{r['steps_crossing']}/{r['steps']}", "pass" if r["pass"] else "FAIL"]
             for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["host time per decode step (initialize_attention_state + update_requests), median "
           f"µs, {threads} torch thread(s)"
           + ("" if load is None else f", load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
           + "; 'in kernels': inside our launchers (on a CPU the torch references)",
           "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default=",".join(map(str, SIZES)),
                        help="active requests per step, a comma-separated list (default "
                             "%(default)s)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timing runs (best per step)")
    parser.add_argument("--sides", default="megatron,ours")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="our context with enable_prefix_caching (megatron-core 0.16.1 "
                             "has none: its side runs without)")
    parser.add_argument("--json", metavar="PATH", help="write the full results here")
    parser.add_argument("--ops", action="store_true", help="also print the per-op breakdown")
    parser.add_argument("--tables", action="store_true",
                        help="also print each size's full table")
    parser.add_argument("--engine", action="store_true",
                        help="instead: syncs per engine step (a tiny random Llama, sync and "
                             "async scheduling, count_engine_steps)")
    args = parser.parse_args(argv)
    if args.engine:
        print(format_engine_syncs(engine_syncs()))
        return 0
    sizes = [int(n) for n in str(args.requests).split(",") if n.strip()]
    results = []
    for requests in sizes:
        result = measure_step_overhead(requests=requests, steps=args.steps,
                                       block_size=args.block_size, max_prompt=args.max_prompt,
                                       max_tokens=args.max_tokens, device=args.device,
                                       repeats=args.repeats, sides=tuple(args.sides.split(",")),
                                       threads=args.threads or None,
                                       prefix_caching=args.prefix_caching)
        results.append(result)
        if args.ops:
            for side, s in result["sides"].items():
                print(f"--- {requests} requests, {side}: ops per step")
                for k, v in sorted(s["op_names_per_step"].items(), key=lambda kv: -kv[1]):
                    print(f"  {v:7.2f}  {k}")
                print(f"--- {requests} requests, {side}: sync sites per step")
                for k, v in sorted(s["sync_sites_per_step"].items(), key=lambda kv: -kv[1]):
                    print(f"  {v:7.2f}  {k}")
        if args.tables or len(sizes) == 1:
            print(format_table(result))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    threads = results[0]["torch_threads"] if results else torch.get_num_threads()
    rows = [summary_row(r) for r in results if "ours" in r["sides"]]
    if rows:
        print(format_summary(rows, threads=threads, load=load))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = {"benchmark": "step_overhead", "sizes": sizes, "torch_threads": threads,
               "load_average": load, "target_ratio": TARGET_RATIO, "max_ops": MAX_OPS,
               "max_syncs": MAX_SYNCS, "summary": rows, "results": results,
               "versions": _versions(),
               "command": "python bench/step_overhead.py " + " ".join(
                   sys.argv[1:] if argv is None else argv)}
        path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
