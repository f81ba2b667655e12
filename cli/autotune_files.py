"""``autotune show`` and ``autotune check``: the config files as tables, and every problem of
them (format, canonical text, configs inside the current search space, key fields).

The folders read are the override folder (``$DYNCTX_AUTOTUNE_DIR``, else the per-user folder
when it exists) and the packaged ``autotune_cache/``, or the roots given with ``--dir``. A
``--dir`` or ``$DYNCTX_AUTOTUNE_DIR`` that is not a folder is an error (exit code 2), and so is
a ``check --dir`` folder without a ``<device>/<kernel>.json`` file: never "0 files, 0
problems".
"""

from __future__ import annotations

import json
from pathlib import Path

from dynctx.autotune_runs import first_line
from dynctx.kernels import autotune
from dynctx.kernels.autotune import KernelConfig, KernelTuning
from dynctx.kernels.registry import import_kernel_modules, key_text

EXIT_BAD_FOLDER = 2


class FolderError(ValueError):
    """A root folder to read is missing, not a folder, or holds no config file."""


def cache_roots(extra: list[str] | None = None) -> list[tuple[str, Path]]:
    """``[(origin, root)]`` in lookup order: the override folder (if any), the packaged folder,
    then each of ``extra``; ``FolderError`` when ``$DYNCTX_AUTOTUNE_DIR`` or an ``extra``
    folder is not a folder."""
    try:
        override = autotune.override_dir()
    except ValueError as exc:
        raise FolderError(str(exc)) from None
    roots = [] if override is None else [("override", override)]
    roots.append(("packaged", autotune.PACKAGED_DIR))
    return roots + [("dir", checked_root(folder, "--dir")) for folder in extra or []]


def checked_root(folder: str, option: str) -> Path:
    """``folder`` as a ``Path``, or ``FolderError`` saying what is wrong with it."""
    path = Path(folder)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        raise FolderError(f"{option} {folder}: {what} (pass a root folder laid out like "
                          "autotune_cache/: <device>/<kernel>.json)")
    return path


def cache_files(roots: list[tuple[str, Path]], device: str | None = None):
    for origin, root in roots:
        for path in sorted(root.glob("*/*.json")):
            if device is None or path.parent.name == device:
                yield origin, path


def require_files(root: Path, option: str) -> None:
    """``FolderError`` when ``root`` holds no ``<device>/<kernel>.json`` file."""
    if next(root.glob("*/*.json"), None) is None:
        inside = next(root.glob("*.json"), None)
        hint = (f"; it holds {inside.name} directly: pass its parent folder, the root above "
                "the device folders" if inside is not None else "")
        raise FolderError(f"{option} {root}: no <device>/<kernel>.json files under it{hint}")


def cmd_show(args) -> int:
    """One block per config file: the key fields every entry shares on one line, then a table
    of the fields that vary (numbers sorted as numbers), the config and its time."""
    import_kernel_modules(quiet=True)
    roots = cache_roots(args.dir)
    shown = 0
    for origin, path in cache_files(roots, args.device):
        if shown:
            print()
        shown += 1
        try:
            data = autotune.load_cache_file(path)
        except ValueError as exc:
            print(f"{path.parent.name}  {path.stem}  ({origin})  INVALID: {exc}")
            continue
        print_file_block(data, origin)
    if not shown:
        where = ", ".join(str(root) for _, root in roots)
        device = f" for device {args.device}" if args.device else ""
        print(f"no committed configs{device} under {where}")
    return 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sort_value(value) -> tuple:
    """Numbers before text, numbers by value (so 16 sorts before 128)."""
    if _is_number(value):
        return (0, value, "")
    return (1, 0, str(value))


def print_file_block(data: dict, origin: str) -> None:
    entries = data["entries"]
    print(f"{data['device']}  {data['kernel']}  ({origin}, {len(entries)} keys)")
    if not entries:
        return
    fields = sorted({name for entry in entries for name in entry["key"]})
    missing = object()
    shared = [name for name in fields
              if len({repr(entry["key"].get(name, missing)) for entry in entries}) == 1
              and name in entries[0]["key"]]
    varying = [name for name in fields if name not in shared]
    # The token count is the bucketed dimension: vary it fastest.
    varying.sort(key=lambda name: (name == "num_tokens", name))
    if shared:
        print("  all keys: " + " ".join(f"{name}={entries[0]['key'][name]}" for name in shared))
    rows = []
    for entry in sorted(entries, key=lambda e: tuple(_sort_value(e["key"].get(name, ""))
                                                       for name in varying)):
        config = str(KernelConfig.from_dict(entry["config"]))
        best = entry["times_us"].get(config, min(entry["times_us"].values()))
        rows.append((*(entry["key"].get(name, "-") for name in varying), config, f"{best:.2f}"))
    numeric = [all(_is_number(entry["key"].get(name)) for entry in entries)
               for name in varying] + [False, True]
    print_table((*varying, "config", "us"), rows, numeric=numeric, indent="  ")


def print_table(header: tuple[str, ...], rows: list[tuple], *, numeric: list[bool] | None = None,
                indent: str = "") -> None:
    """Columns two spaces apart; numeric columns right-aligned."""
    rows = [tuple(str(c) for c in row) for row in rows]
    numeric = numeric or [False] * len(header)
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells) -> str:
        return indent + "  ".join(c.rjust(w) if right else c.ljust(w)
                                  for c, w, right in zip(cells, widths, numeric)).rstrip()

    print(line(header))
    for row in rows:
        print(line(row))


def check_file(path: Path) -> list[str]:
    """Every problem of one config file; empty when it is valid, canonical and in range."""
    problems = []
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        return [f"{path}: not valid JSON ({exc})"]
    try:
        autotune.validate_cache_data(data, str(path))
    except ValueError as exc:
        return [str(exc)]
    if data["kernel"] != path.stem:
        problems.append(f"{path}: kernel {data['kernel']!r} does not match the file name")
    if data["device"] != path.parent.name:
        problems.append(f"{path}: device {data['device']!r} does not match the folder name")
    ordered = sorted(data["entries"], key=lambda e: json.dumps(e["key"], sort_keys=True))
    if text != autotune.canonical_json({**data, "entries": ordered}):
        problems.append(f"{path}: not canonical (rewrite it with autotune.write_cache_file: "
                        "sorted keys and entries, 2-space indent, final newline)")
    tuning = autotune.registered().get(data["kernel"])
    if tuning is None:
        problems.append(f"{path}: no registered kernel named {data['kernel']!r}")
        return problems
    fields = key_fields(tuning)
    for i, entry in enumerate(data["entries"]):
        key = entry["key"]
        where = f"{path}: entry {i} ({key_text(key)})"
        if fields is not None and set(key) != fields:
            problems.append(f"{where}: key fields {sorted(key)} != "
                            f"{tuning.name}'s {sorted(fields)}")
            continue
        tokens = key.get(tuning.token_field)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or \
                autotune.bucket_tokens(max(tokens, 0)) != tokens:
            problems.append(f"{where}: {tuning.token_field}={tokens!r} is not a power-of-two "
                            "bucket")
        config = KernelConfig.from_dict(entry["config"])
        try:
            space = tuning.configs(key)
        except Exception as exc:
            problems.append(f"{where}: {tuning.name}_configs(key) raised {first_line(exc)}")
            continue
        if config not in space:
            problems.append(f"{where}: config {config} is outside the current search space")
        if str(config) not in entry["times_us"]:
            problems.append(f"{where}: the chosen config {config} has no measured time")
    return problems


def key_fields(tuning: KernelTuning) -> set[str] | None:
    """The key fields of a kernel, read off its presets (None when it declares none)."""
    keys = tuning.presets() if tuning.presets else []
    return set(keys[0]) if keys else None


def cmd_check(args) -> int:
    status = import_kernel_modules(quiet=True)
    if args.dir:
        roots = [("dir", checked_root(folder, "--dir")) for folder in args.dir]
        for _, root in roots:
            require_files(root, "--dir")
    else:
        roots = cache_roots()
    files = [path for _, path in cache_files(roots)]
    problems = [p for path in files for p in check_file(path)]
    for module, why in status.items():
        if why != "ok" and not why.endswith("does not exist yet"):
            problems.append(f"dynctx.kernels.{module}: {why}")
    for problem in problems:
        print(f"PROBLEM {problem}")
    where = ", ".join(str(root) for _, root in roots)
    print(f"dynctx autotune check: {len(files)} files under {where}, {len(problems)} problems")
    return 1 if problems else 0
