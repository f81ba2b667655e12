"""Autotune registry: kernels declare their search space, key and default; launchers look up.

The runtime never benchmarks. ``resolve_config(name, key, device)`` returns ``(config, source)``
looked up in this order:

1. the override folder (``<dir>/<device>/<kernel>.json``): the one ``$DYNCTX_AUTOTUNE_DIR``
   names (an error when it names no folder), else the per-user folder ``user_cache_dir()``
   when it exists (where ``python -m dynctx autotune tune`` writes by default);
2. the packaged ``autotune_cache/<device>/<kernel>.json``;

in each file first the exact key, then the nearest token bucket with every other key field
equal; last the kernel's heuristic default, logged once with the command that would fill the
gap. A committed config outside the kernel's current search space is ignored with a warning.
Under the Triton interpreter the device is ``"interpreter"``, for which nothing is packaged, so
launches use the default unless an override folder provides a file (the tests do that).

Every launch resolves its config, so the answer is cached per (kernel, device, override folder,
packaged folder, key): a cached lookup is one dict access. ``write_cache_file`` empties the
cache; a file that another process rewrites is read again by the next process (or after
``clear_lookup_cache()``).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .backend import env_get, triton_interpreting

logger = logging.getLogger("dynctx.autotune")

OVERRIDE_ENV = "DYNCTX_AUTOTUNE_DIR"
PACKAGED_DIR = Path(__file__).resolve().parent.parent / "autotune_cache"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: constexpr meta-parameters plus ``num_warps``/``num_stages``."""

    meta: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 1

    @classmethod
    def make(cls, *, num_warps: int = 4, num_stages: int = 1, **meta: int) -> "KernelConfig":
        return cls(tuple(sorted(meta.items())), num_warps, num_stages)

    @property
    def kwargs(self) -> dict[str, int]:
        return dict(self.meta)

    def launch_kwargs(self) -> dict[str, int]:
        """Keyword arguments for ``kernel[grid](...)``: meta-parameters, warps and stages."""
        return {**dict(self.meta), "num_warps": self.num_warps, "num_stages": self.num_stages}

    def to_dict(self) -> dict[str, Any]:
        return {"meta": dict(self.meta), "num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "KernelConfig":
        return cls.make(num_warps=int(obj["num_warps"]), num_stages=int(obj["num_stages"]),
                        **{k: int(v) for k, v in obj["meta"].items()})

    def __str__(self) -> str:
        meta = ",".join(f"{k}={v}" for k, v in self.meta)
        return f"{meta},w{self.num_warps},s{self.num_stages}"


@dataclass(frozen=True)
class KernelTuning:
    """A kernel's tuning declaration (docs/DESIGN.md §5).

    ``configs(key)`` is the search space, ``default_config(key)`` the heuristic default and
    ``tune_key(**shapes)`` builds the key: model dimensions and dtype exact, the token count
    (``token_field``) bucketed to a power of two.
    """

    name: str
    configs: Callable[[dict], list[KernelConfig]]
    default_config: Callable[[dict], KernelConfig]
    tune_key: Callable[..., dict]
    token_field: str = "num_tokens"
    make_case: Callable[[dict, torch.device], "TuneCase"] | None = None
    presets: Callable[[], list[dict]] | None = None


class TuneCase:
    """Scratch buffers for one key, built by a kernel's ``make_case(key, device)``.

    ``run(config)`` launches the Triton kernel with ``config`` on the scratch buffers;
    ``check(config)`` runs it and raises ``AssertionError`` unless the result matches the torch
    reference (bit-exact for data movement, a stated tolerance for arithmetic);
    ``bytes_moved`` is the bytes read plus written by one launch, for GB/s and the ratio to a
    device-to-device copy. The tune CLI and ``bench/`` use nothing else.
    """

    bytes_moved: int = 0

    def run(self, config: KernelConfig) -> None:
        raise NotImplementedError

    def run_reference(self) -> None:
        raise NotImplementedError

    def check(self, config: KernelConfig) -> None:
        raise NotImplementedError


_TUNINGS: dict[str, KernelTuning] = {}
_WARNED: set[tuple] = set()


def register(tuning: KernelTuning) -> KernelTuning:
    if tuning.name in _TUNINGS and _TUNINGS[tuning.name] is not tuning:
        raise ValueError(f"kernel tuning {tuning.name!r} is registered twice")
    _TUNINGS[tuning.name] = tuning
    clear_lookup_cache()
    return tuning


def get_tuning(name: str) -> KernelTuning:
    try:
        return _TUNINGS[name]
    except KeyError:
        raise KeyError(f"no kernel named {name!r}; known: {sorted(_TUNINGS)}") from None


def registered() -> dict[str, KernelTuning]:
    return dict(_TUNINGS)


def bucket_tokens(num_tokens: int) -> int:
    """Token counts go into keys as the next power of two (at least 1)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    return 1 if num_tokens <= 1 else 1 << (int(num_tokens) - 1).bit_length()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device | str | None = None) -> str:
    """Folder name of a device's configs: ``NVIDIA_H200``; ``interpreter``; ``cpu``."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device() if device.index is None else device.index
        return _cuda_device_name(index)
    return "interpreter" if triton_interpreting() else "cpu"


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", torch.cuda.get_device_name(index)).strip("_")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, indent=2) + "\n"


@functools.lru_cache(maxsize=None)
def _load_file(path: str, mtime_ns: int, size: int) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError do not name the file
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    validate_cache_data(data, path)
    return data


def validate_cache_data(data: Any, path: str = "<data>") -> None:
    """Raise ``ValueError`` naming ``path`` unless ``data`` is a well-formed config file."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be an object")
    for name in ("device", "kernel", "entries", "format", "versions"):
        if name not in data:
            raise ValueError(f"{path}: missing field {name!r}")
    if data["format"] != FORMAT_VERSION:
        raise ValueError(f"{path}: format {data['format']!r} != {FORMAT_VERSION}")
    for name in ("device", "kernel"):
        if not isinstance(data[name], str) or not data[name]:
            raise ValueError(f"{path}: {name!r} must be a non-empty string")
    if not isinstance(data["versions"], dict):
        raise ValueError(f"{path}: 'versions' must be an object")
    if not isinstance(data["entries"], list):
        raise ValueError(f"{path}: 'entries' must be a list")
    seen_keys = set()
    for i, entry in enumerate(data["entries"]):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: entry {i} must be an object")
        for name in ("key", "config", "times_us"):
            if name not in entry:
                raise ValueError(f"{path}: entry {i} lacks {name!r}")
        key = entry["key"]
        if not isinstance(key, dict) or not key or not all(
                isinstance(v, (str, int, float, bool)) for v in key.values()):
            raise ValueError(f"{path}: entry {i} key must be a non-empty object of scalars")
        key_text = json.dumps(key, sort_keys=True)
        if key_text in seen_keys:
            raise ValueError(f"{path}: entry {i} repeats key {key}")
        seen_keys.add(key_text)
        try:
            KernelConfig.from_dict(entry["config"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: entry {i} has a malformed config ({exc!r})") from None
        times = entry["times_us"]
        if not isinstance(times, dict) or not times or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                and t > 0
                for t in times.values()):
            raise ValueError(f"{path}: entry {i} has no measured times")


def load_cache_file(path: Path) -> dict:
    path = Path(path)
    stat = path.stat()
    return _load_file(str(path), stat.st_mtime_ns, stat.st_size)


def user_cache_dir() -> Path:
    """The per-user override folder: ``$XDG_CACHE_HOME/dynctx/autotune_cache``, by default
    ``~/.cache/dynctx/autotune_cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dynctx" / "autotune_cache"


def override_dir() -> Path | None:
    """The override folder read before the packaged one: ``$DYNCTX_AUTOTUNE_DIR`` (a
    ``ValueError`` when it is set but names no folder), else ``user_cache_dir()`` when it
    exists, else None."""
    value = os.environ.get(OVERRIDE_ENV)
    if value:
        path = Path(value)
        if not path.is_dir():
            what = "does not exist" if not path.exists() else "is not a folder"
            raise ValueError(f"${OVERRIDE_ENV}={value} {what}: point it at a folder laid out like "
                             "autotune_cache/ (<device>/<kernel>.json), or unset it")
        return path
    path = user_cache_dir()
    return path if path.is_dir() else None


def cache_paths(name: str, device: str) -> list[tuple[str, Path]]:
    """Candidate files for one kernel on one device, in lookup order."""
    paths = []
    override = override_dir()
    if override is not None:
        paths.append(("override", override / device / f"{name}.json"))
    paths.append(("packaged", PACKAGED_DIR / device / f"{name}.json"))
    return paths


def _lookup_in_file(tuning: KernelTuning, data: dict, key: dict, path: Path):
    space = set(tuning.configs(key))
    field_name = tuning.token_field
    exact, nearest = None, None
    for entry in data["entries"]:
        entry_key = entry["key"]
        config = KernelConfig.from_dict(entry["config"])
        same_shape = {k: v for k, v in entry_key.items() if k != field_name} == {
            k: v for k, v in key.items() if k != field_name
        }
        if not same_shape:
            continue
        if config not in space:
            tag = ("stale", str(path), str(config))
            if tag not in _WARNED:
                _WARNED.add(tag)
                warnings.warn(f"{path}: config {config} for key {entry_key} is outside the search "
                              f"space of {tuning.name}; ignored", stacklevel=3)
            continue
        if entry_key == key:
            exact = config
            break
        if field_name in entry_key and field_name in key:
            distance = abs(math.log2(max(1, entry_key[field_name]))
                           - math.log2(max(1, key[field_name])))
            rank = (distance, -entry_key[field_name])
            if nearest is None or rank < nearest[0]:
                nearest = (rank, config)
    if exact is not None:
        return exact, "exact"
    if nearest is not None:
        return nearest[1], "nearest"
    return None, None


# (kernel, device, override folder, packaged folder, key items) -> (tuning, (config, source)):
# a hit counts only for the tuning it was resolved for (tests swap tunings under one name).
_LOOKUPS: dict[tuple, tuple[KernelTuning, tuple[KernelConfig, str]]] = {}
# Bumped by every clear_lookup_cache(): a launch plan made with a resolved config stores the
# lookup_state() it was resolved under and is only used under the same one.
_GENERATION = [0]


def clear_lookup_cache() -> None:
    """Forget every resolved config: the next lookups read the files again."""
    _LOOKUPS.clear()
    _GENERATION[0] += 1


def lookup_state() -> tuple:
    """What a resolved config depends on besides the kernel, device and key: the cache's
    generation and the two variables that name the override folder."""
    return (_GENERATION[0], env_get(OVERRIDE_ENV), env_get("XDG_CACHE_HOME"))


def resolve_config(name: str, key: dict, device: torch.device | str | None = None
                   ) -> tuple[KernelConfig, str]:
    """Return ``(config, source)`` for kernel ``name`` at ``key``; never benchmarks.

    ``source`` is ``"<override|packaged>-<exact|nearest>:<path>"`` or ``"default"``. Cached
    per kernel, device, override folder, packaged folder and key (module docstring).
    """
    tuning = get_tuning(name)
    dev = device_name(device)
    # The override folder is $DYNCTX_AUTOTUNE_DIR's, else the per-user one under XDG_CACHE_HOME.
    lookup = (name, dev, os.environ.get(OVERRIDE_ENV), os.environ.get("XDG_CACHE_HOME"),
              PACKAGED_DIR, tuple(key.items()))
    hit = _LOOKUPS.get(lookup)
    if hit is not None and hit[0] is tuning:
        return hit[1]
    resolved = _resolve_uncached(tuning, key, dev)
    _LOOKUPS[lookup] = (tuning, resolved)
    return resolved


def _resolve_uncached(tuning: KernelTuning, key: dict, dev: str) -> tuple[KernelConfig, str]:
    name = tuning.name
    for origin, path in cache_paths(name, dev):
        if not path.is_file():
            continue
        config, how = _lookup_in_file(tuning, load_cache_file(path), key, path)
        if config is not None:
            return config, f"{origin}-{how}:{path}"
    tag = ("default", name, dev, tuple(sorted(key.items())))
    if tag not in _WARNED:
        _WARNED.add(tag)
        level = logging.DEBUG if dev in ("cpu", "interpreter") else logging.INFO
        logger.log(level, "dynctx: no tuned config for %s on %s at %s; using the default. "
                   "Fill it with: python -m dynctx autotune tune --kernel %s", name, dev, key, name)
    return tuning.default_config(key), "default"


def write_cache_file(path: Path, *, device: str, kernel: str, entries: list[dict],
                     versions: dict[str, str]) -> None:
    """Write one kernel's configs canonically (sorted, indented, newline-terminated)."""
    entries = sorted(entries, key=lambda e: json.dumps(e["key"], sort_keys=True))
    data = {"format": FORMAT_VERSION, "device": device, "kernel": kernel,
            "versions": versions, "entries": entries}
    validate_cache_data(data, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(canonical_json(data))
    clear_lookup_cache()
