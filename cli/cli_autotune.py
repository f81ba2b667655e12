"""``python -m dynctx autotune tune|show|check|bench``: tune, inspect, check and benchmark kernels.

- ``tune`` (CUDA only): for every registered kernel and each key of its ``presets()``, checks
  every config of the search space against the torch reference, times the ones that pass under
  CUDA graphs, and merges the fastest into ``<out>/<device>/<kernel>.json``; ``<out>`` defaults
  to the folder launchers read first ($DYNCTX_AUTOTUNE_DIR, else a per-user folder).
- ``show``: the committed (and override) configs as a table.
- ``check``: validates the committed files (format, canonical text, configs inside the current
  search space, key fields); exit code 1 on any problem.
- ``bench`` (CUDA only): times the resolved config of every preset key against the torch
  reference and a device-to-device copy of the same bytes; writes the results to ``--out``.

The kernels are found by importing ``dynctx.kernels.<module>`` for every name of
``KERNEL_MODULES`` (``dynctx.kernels.registry``, shared with ``bench/``): each module registers
its ``KernelTuning`` with ``autotune.register``. Each command lives in its own module:
``dynctx.autotune_tune``, ``dynctx.autotune_files`` (show, check), ``dynctx.autotune_bench``;
``dynctx.autotune_runs`` holds what tune and bench share.
"""

from __future__ import annotations

import sys

from dynctx._cli_common import (
    ArgumentParser,
    HelpFormatter,
    non_negative_int,
    plain,
    positive_float,
    positive_int,
    program_name,
    run_to_closed_stdout,
)
from dynctx.autotune_bench import cmd_bench
from dynctx.autotune_files import FolderError, check_file, cmd_check, cmd_show
from dynctx.autotune_files import key_fields as _key_fields  # noqa: F401 (tests read it here)
from dynctx.autotune_tune import cmd_tune
from dynctx.kernels import autotune
from dynctx.kernels.registry import PRESET_MODULES

__all__ = ["build_parser", "check_file", "main"]

DESCRIPTIONS = {
    "tune": "Tune every kernel's preset keys on this CUDA GPU: check each config against the "
            "torch reference, time the ones that pass, keep the fastest.",
    "show": "Print the tuned configs (packaged and override folders) as one table per file.",
    "check": "Validate the config files: format, canonical text, search space, key fields.",
    "bench": "Time the resolved configs on this CUDA GPU against the torch reference and a "
             "copy of the same bytes.",
}


def build_parser(prog: str = "python -m dynctx autotune") -> ArgumentParser:
    summary, commands = __doc__.split("\n\n")[:2]
    parser = ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description=plain(summary).replace("python -m dynctx autotune", prog),
        epilog=plain(commands))
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str):
        sub = commands.add_parser(name, formatter_class=HelpFormatter,
                                  help=DESCRIPTIONS[name].split(":")[0].rstrip("."),
                                  description=DESCRIPTIONS[name])
        sub.set_defaults(parser=sub)  # its errors name the command: "... autotune check: error"
        return sub

    def add_selection(sub):
        sub.add_argument("--kernel", action="append", metavar="NAME",
                         help="a registered kernel name (repeatable); default: every kernel")
        sub.add_argument("--preset", choices=("all", *PRESET_MODULES), default="all",
                         help="kernel group: llama (the attention path every model shares), "
                              "mla, mamba, or all (default)")
        sub.add_argument("--max-seconds", type=positive_float, default=None,
                         help="start no new kernel or key after this many seconds; the rest is "
                              "listed as skipped")
        sub.add_argument("--warmup", type=non_negative_int, default=10,
                         help="eager calls before timing")
        sub.add_argument("--rep", type=positive_int, default=20, help="timed CUDA-graph replays")

    tune = add("tune")
    add_selection(tune)
    tune.add_argument("--out", metavar="DIR", default=None,
                      help=f"root folder of the configs; default ${autotune.OVERRIDE_ENV}, else "
                           "the per-user folder "
                           f"({autotune.user_cache_dir()}); launchers read either first. "
                           "--out autotune_cache writes the packaged files of a checkout")
    tune.add_argument("--skip-existing", action="store_true",
                      help="keep keys already present in the output files instead of re-tuning")
    tune.set_defaults(run=cmd_tune)

    show = add("show")
    show.add_argument("--device", default=None,
                      help="only this device folder, e.g. NVIDIA_H200 (default: every device)")
    show.add_argument("--dir", action="append", metavar="DIR",
                      help="also show the configs under this root folder (repeatable)")
    show.set_defaults(run=cmd_show)

    check = add("check")
    check.add_argument("--dir", action="append", metavar="DIR",
                       help="check the files under this root folder (repeatable) instead of "
                            "the packaged and the override folder")
    check.set_defaults(run=cmd_check)

    bench = add("bench")
    add_selection(bench)
    bench.add_argument("--out", metavar="FILE", default=None,
                       help="results file (JSON); without it the table is printed and nothing "
                            "is written")
    bench.set_defaults(run=cmd_bench)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog or f"{program_name()} autotune")
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except FolderError as exc:
        args.parser.exit_with_error(str(exc))


if __name__ == "__main__":
    sys.exit(run_to_closed_stdout(main))
