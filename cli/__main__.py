"""Command line: ``python -m dynctx`` (or the ``dynctx`` console script)."""

from __future__ import annotations

import sys

from dynctx import __version__
from dynctx._cli_common import ArgumentParser, HelpFormatter, program_name, run_to_closed_stdout

COMMANDS = {
    "demo": "in-flight batching of a small random model (Llama, or --model NAME) through\n"
            "            the context, checked against transformers (needs pip install "
            "'dynctx[demo]')",
    "autotune": "tune (GPU), show, check and bench the kernels' launch configs",
}


def build_parser(prog: str) -> ArgumentParser:
    commands = "\n".join(f"  {name:<10}{text}" for name, text in COMMANDS.items())
    parser = ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="dynctx: a dynamic inference context (paged KV cache + in-flight batching) "
                    "with Triton kernels.",
        epilog=f"commands:\n{commands}\n\n'{prog} <command> --help' describes a command.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to run")
    parser.add_argument("--version", action="version", version=f"dynctx {__version__}")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or program_name()
    parser = build_parser(prog)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "--version":
        parser.parse_args(argv[:1])
    if argv[0].startswith("-"):
        parser.error(f"unknown option {argv[0]}; the command comes first: "
                     f"{', '.join(sorted(COMMANDS))}")
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from dynctx.cli_demo import main as command_main
    elif command == "autotune":
        from dynctx.cli_autotune import main as command_main
    else:
        parser.error(f"unknown command {command!r}; choose from {', '.join(sorted(COMMANDS))}")
    return run_to_closed_stdout(lambda: command_main(rest, prog=f"{prog} {command}"))


if __name__ == "__main__":
    sys.exit(main())
