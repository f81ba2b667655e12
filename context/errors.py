"""Context errors, their (de)serialisation, and the memory-size formatter."""

from __future__ import annotations

import math
import numbers
from typing import Optional


class ContextOverflowError(Exception):
    """A request does not fit in the context.

    ``is_transient`` marks whether the request may fit later (the context is full now) or never
    will (it is too large for this context).
    """

    def __init__(self, request_id: Optional[int], message: Optional[str] = None, *,
                 is_transient: bool = True):
        self.request_id = request_id
        self.message = message
        self.is_transient = is_transient
        text = f"request {'--' if request_id is None else request_id}"
        if message is not None:
            text += f" | {message}"
        super().__init__(text)

    def __reduce__(self):
        # Exception's default pickles ``self.args`` (the formatted text) and calls
        # ``cls(text)`` on load, which would make the text the request id ("request request 5 |
        # ...") and cannot call subclasses whose constructor takes other arguments. Rebuild from
        # the fields instead, without running any subclass constructor, then restore the
        # instance dict (request_id, message, is_transient and any subclass field).
        return (_rebuild_error, (type(self), self.request_id, self.message, self.is_transient),
                self.__dict__.copy())


def _rebuild_error(error_type: type, request_id: Optional[int], message: Optional[str],
                   is_transient: bool) -> "ContextOverflowError":
    """An instance of ``error_type`` with these fields, built through the base constructor."""
    error = ContextOverflowError.__new__(error_type)
    ContextOverflowError.__init__(error, request_id, message, is_transient=is_transient)
    return error


class StepShapeError(ValueError, AssertionError):
    """A per-request tensor handed to the context (``active_requests_mask``, ``new_tokens``)
    does not match the active requests. A ``ValueError``, and an ``AssertionError`` too: where
    Megatron-Core asserts these shapes, code written for it catches ``AssertionError``."""


class SpeculativeConfigError(ValueError, AssertionError):
    """``num_speculative_tokens`` out of range (not below ``block_size_tokens``). A
    ``ValueError``, and an ``AssertionError`` as Megatron-Core 0.19 asserts it."""


class NotHybridError(RuntimeError, AssertionError):
    """A Mamba method called on a context without Mamba layers. A ``RuntimeError``, and an
    ``AssertionError`` as Megatron-Core asserts it."""


class RequestOverflowError(ContextOverflowError):
    """Adding the request would overflow the maximum request count."""


class TokenOverflowError(ContextOverflowError):
    """Adding the request would overflow the maximum token count of a step."""


class MaxSequenceLengthOverflowError(ContextOverflowError):
    """The request is longer than ``max_sequence_length``; never transient."""

    def __init__(self, request_id: Optional[int], message: Optional[str] = None, **_ignored):
        super().__init__(request_id, message, is_transient=False)


class BlockOverflowError(ContextOverflowError):
    """Adding the request would overflow the available KV blocks."""


class ActiveRequestCountOverflowError(ContextOverflowError):
    """More requests are active than the context's maximum."""

    def __init__(self, max_request_count: int, active_request_count: int):
        if active_request_count <= max_request_count:
            raise ValueError(
                f"active_request_count ({active_request_count}) must exceed "
                f"max_request_count ({max_request_count}) for this error")
        super().__init__(None, f"active_request_count ({active_request_count}) > "
                               f"max_request_count ({max_request_count}).")
        self.max_request_count = max_request_count
        self.active_request_count = active_request_count


class TensorStateDeallocatedError(ContextOverflowError):
    """The context's tensors are deallocated (the engine is suspended)."""

    @classmethod
    def suspended(cls, request_id: Optional[int] = None) -> "TensorStateDeallocatedError":
        return cls(request_id, "the context's tensors are deallocated (suspended); call "
                               "allocate_all_tensors(is_init=False) first")


_ERROR_TYPES = {cls.__name__: cls for cls in (
    ContextOverflowError, RequestOverflowError, TokenOverflowError,
    MaxSequenceLengthOverflowError, BlockOverflowError, ActiveRequestCountOverflowError,
    TensorStateDeallocatedError)}


class ContextErrorFactory:
    """Serialise context errors to plain dicts and back (every error type round-trips)."""

    @classmethod
    def serialize(cls, error: ContextOverflowError) -> dict:
        if not isinstance(error, ContextOverflowError):
            raise TypeError(f"error must be a ContextOverflowError, got {type(error).__name__}")
        return {"type": type(error).__name__, "request_id": error.request_id,
                "message": error.message, "is_transient": error.is_transient}

    @classmethod
    def deserialize(cls, obj: dict) -> ContextOverflowError:
        try:
            error_type = _ERROR_TYPES[obj["type"]]
        except KeyError:
            raise ValueError(f"obj['type']={obj.get('type')!r} is not a context error; "
                             f"known: {sorted(_ERROR_TYPES)}") from None
        return _rebuild_error(error_type, obj["request_id"], obj["message"], obj["is_transient"])


_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("bytes", 1))


def get_mem_size_str(n_bytes: int) -> str:
    """Human-readable size with 1024-based units: ``get_mem_size_str(1536) == '1.5 KiB'``.

    ``n_bytes`` is a finite, non-negative real number (int, float, numpy scalar); anything else
    raises ``TypeError`` (not a number) or ``ValueError`` (negative, NaN or infinite) naming it.
    """
    if isinstance(n_bytes, bool) or not isinstance(n_bytes, numbers.Real):
        raise TypeError(f"n_bytes={n_bytes!r} must be a real number of bytes, "
                        f"got {type(n_bytes).__name__}")
    if not math.isfinite(n_bytes):
        raise ValueError(f"n_bytes={n_bytes} must be a finite number of bytes")
    if n_bytes < 0:
        raise ValueError(f"n_bytes={n_bytes} must be >= 0")
    for name, unit in _UNITS:
        if n_bytes >= unit:
            return f"{n_bytes / unit:.3g} {name}"
    return "0 bytes"
