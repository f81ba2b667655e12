"""The context's sizing warning, asserted where the tests build small buffers on purpose.

A context whose active budget holds fewer blocks than one request of ``max_sequence_length``
needs warns at construction ("... a long request may pause with no way to resume ...";
``context/sizing.py``). Many tests build such contexts on purpose (tiny buffers put requests
under pressure; their requests are short). ``built(build)`` builds one and asserts the warning
exactly when the context's own counts say it is due, so that it is checked rather than printed;
every other warning passes through unchanged.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, TypeVar

T = TypeVar("T")
SIZING_WARNING = "a long request may pause with no way to resume"


def _is_sizing_warning(record: warnings.WarningMessage) -> bool:
    return issubclass(record.category, UserWarning) and SIZING_WARNING in str(record.message)


def built(build: Callable[[], T]) -> T:
    """``build()`` (a ``DynamicInferenceContext`` or an engine with ``.context``), checking that
    the sizing warning came exactly when the active budget cannot hold one request of
    ``max_sequence_length``; other warnings are re-issued."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = build()
    finally:
        for record in caught:
            if not _is_sizing_warning(record):
                warnings.warn_explicit(record.message, record.category, record.filename,
                                       record.lineno)
    ctx = getattr(result, "context", result)
    needed = math.ceil(ctx.max_sequence_length / ctx.block_size_tokens)
    short = ctx.block_allocator.active_count < needed
    sizing = [record for record in caught if _is_sizing_warning(record)]
    assert len(sizing) == int(short), (
        f"active budget {ctx.block_allocator.active_count} blocks, one request of "
        f"max_sequence_length={ctx.max_sequence_length} needs {needed}: expected "
        f"{int(short)} sizing warning(s), got {[str(r.message) for r in sizing]}")
    return result
