"""Helpers shared by the command-line entry points: the program name, plain help text, and a
quiet exit when the reader of stdout goes away (``... | head``)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable

_LITERAL = re.compile(r"``([^`]+)``")


def program_name(argv0: str | None = None) -> str:
    """``"dynctx"`` when started through the console script, else ``"python -m dynctx"``."""
    argv0 = (sys.argv[0] if sys.argv else "") if argv0 is None else argv0
    name = os.path.basename(argv0)
    if name.endswith(".exe"):
        name = name[:-4]
    return "dynctx" if name in ("dynctx", "dynctx-script.py") else "python -m dynctx"


def plain(text: str) -> str:
    """Docstring text for ``--help``: reST literals (double backquotes) become plain words."""
    return _LITERAL.sub(r"\1", text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the description's line breaks; append "(default: X)" to an option's help when it has
    a default worth showing (not None, not a False flag) and the help does not state it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or "default" in text or default is argparse.SUPPRESS \
                or default is None or default is False or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def run_to_closed_stdout(run: Callable[[], int]) -> int:
    """``run()``, then flush stdout; if the reader closed the pipe, stop quietly with exit code
    1 instead of a ``BrokenPipeError`` traceback (the recipe of Python's ``signal`` docs)."""
    try:
        code = run()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Later writes, and the flush at interpreter exit, must not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
