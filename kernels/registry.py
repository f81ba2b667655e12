"""The kernel registry: which modules declare kernels, in what order, and how to pick them.

Importing ``dynctx.kernels.<module>`` registers its ``KernelTuning`` with ``autotune.register``;
this module lists those modules and selects among their tunings. The autotune command line
(``python -m dynctx autotune``), ``bench/`` and the tests read it from here, so that none of them
needs the other (``bench/`` does not import the command line).
"""

from __future__ import annotations

import importlib
import sys

from . import autotune
from .autotune import KernelTuning

# Kernel modules in tuning order. `--preset` picks groups of modules: "llama" is the attention
# path every model shares, "mla" and "mamba" the kernels only those models add.
KERNEL_MODULES = ("kv_append", "rope", "rope_kv_append", "step_metadata", "last_token_logits",
                  "compaction", "mla_latent", "mamba_state", "speculative_rewind",
                  "paged_attention")
PRESET_MODULES = {
    "llama": ("kv_append", "rope", "rope_kv_append", "step_metadata", "last_token_logits",
              "compaction", "paged_attention"),
    "mla": ("mla_latent",),
    "mamba": ("mamba_state", "speculative_rewind"),
}


def import_kernel_modules(*, quiet: bool = False) -> dict[str, str]:
    """Import every kernel module; return ``{module: "ok" | reason it was skipped}``."""
    status = {}
    for module in KERNEL_MODULES:
        full_name = f"dynctx.kernels.{module}"
        try:
            importlib.import_module(full_name)
            status[module] = "ok"
        except ModuleNotFoundError as exc:
            status[module] = (f"kernels/{module}.py does not exist yet" if exc.name == full_name
                              else f"import failed: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a broken module must not hide the others
            status[module] = f"import failed: {type(exc).__name__}: {exc}"
        if status[module] != "ok" and not quiet:
            print(f"dynctx kernels: skipped {module}: {status[module]}", file=sys.stderr,
                  flush=True)
    return status


def module_of(tuning: KernelTuning) -> str:
    """The kernel module (``kv_append``) that declared ``tuning``."""
    function = tuning.make_case or tuning.configs
    return getattr(function, "__module__", "").rsplit(".", 1)[-1]


def select_tunings(kernels: list[str] | None, preset: str = "all") -> list[KernelTuning]:
    """Registered tunings in ``KERNEL_MODULES`` order, filtered by name and preset group."""
    tunings = autotune.registered()
    modules = KERNEL_MODULES if preset == "all" else PRESET_MODULES[preset]
    rank = {m: i for i, m in enumerate(KERNEL_MODULES)}
    chosen = [t for t in tunings.values()
              if module_of(t) in modules or (preset == "all" and module_of(t) not in rank)]
    if kernels:
        unknown = sorted(set(kernels) - set(tunings))
        if unknown:
            raise SystemExit(f"dynctx autotune: no registered kernel named {unknown}; "
                             f"known: {sorted(tunings)}")
        chosen = [tunings[name] for name in kernels]
    return sorted(chosen, key=lambda t: (rank.get(module_of(t), len(rank)), t.name))


def key_text(key: dict) -> str:
    """``a=1,b=x``: a tuning key as one sorted line, for tables and benchmark group names."""
    return ",".join(f"{k}={v}" for k, v in sorted(key.items()))
