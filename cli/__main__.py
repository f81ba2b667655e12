"""Command line: ``python -m dynctx {demo,autotune} ...``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m dynctx", description=__doc__)
    parser.add_argument("command", choices=["demo", "autotune"], help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from dynctx.cli_demo import main as demo_main

        return demo_main(rest)
    if command == "autotune":
        from dynctx.cli_autotune import main as autotune_main

        return autotune_main(rest)
    parser.error(f"unknown command {command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
