"""Helpers shared by the command-line entry points: the program name, plain help text, a parser
whose errors are one line, argument types with ranges, and a quiet exit when the reader of
stdout goes away (``... | head``)."""

from __future__ import annotations

import argparse
import math
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


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: ``prog: error: message (see 'prog --help')`` on stderr
    and exit code 2, instead of the whole usage block first. The ``SystemExit`` it raises
    carries the message as its text (``str(exc)``) and 2 as its code."""

    def error(self, message: str):
        self.exit_with_error(message)

    def exit_with_error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        exc = SystemExit(message)
        exc.code = 2
        raise exc


def _number(text: str, kind: type, low, low_inclusive: bool, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    if value < low or (value == low and not low_inclusive):
        raise argparse.ArgumentTypeError(f"{text} is not {what}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _number(text, int, 1, True, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _number(text, int, 0, True, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, 0.0, False, "a finite number > 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(text, float, 0.0, True, "a finite number >= 0")
