"""The context's sizing warning, asserted where the tests build small buffers on purpose.

A context whose active budget holds fewer blocks than one request of ``max_sequence_length``
needs warns at construction ("... a long request may pause with no way to resume ...";
``context/sizing.py``). Many tests build such contexts on purpose (tiny buffers put requests
under pressure; their requests are short). ``built(build)`` builds one and asserts the warning
exactly when the context's own counts say it is due, so that it is checked rather than printed;
every other warning passes through unchanged. A test about the warning's text builds the context
itself (``helpers.context_args``) inside ``pytest.warns``.
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
    # (Engine.from_transformers may build its context twice, so count presence, not copies.)
    sizing = [str(record.message) for record in caught if _is_sizing_warning(record)]
    assert bool(sizing) == short, (
        f"active budget {ctx.block_allocator.active_count} blocks, one request of "
        f"max_sequence_length={ctx.max_sequence_length} needs {needed}: expected "
        f"{'the' if short else 'no'} sizing warning, got {sizing}")
    return result
