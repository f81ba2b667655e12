"""Context errors survive pickling (what multiprocessing and RPC do to them) and the memory-size
formatter refuses what is not a size."""

import math
import pickle

import numpy as np
import pytest

from dynctx.context import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextErrorFactory,
    ContextOverflowError,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TensorStateDeallocatedError,
    TokenOverflowError,
    get_mem_size_str,
)

ERRORS = [
    ContextOverflowError(3, "x"),
    ContextOverflowError(None),
    RequestOverflowError(5, "msg"),
    TokenOverflowError(2, "t"),
    MaxSequenceLengthOverflowError(4, "long"),
    BlockOverflowError(None, is_transient=False),
    ActiveRequestCountOverflowError(4, 9),
    TensorStateDeallocatedError(7, "suspended"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: f"{type(e).__name__}-{e.request_id}")
@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_pickle_round_trip_keeps_type_fields_and_text(error, protocol):
    back = pickle.loads(pickle.dumps(error, protocol=protocol))
    assert type(back) is type(error)
    assert (back.request_id, back.message, back.is_transient) == \
        (error.request_id, error.message, error.is_transient)
    assert str(back) == str(error)
    assert back.args == error.args
    assert not str(back).startswith("request request")


def test_pickled_error_text_has_one_prefix():
    back = pickle.loads(pickle.dumps(RequestOverflowError(5, "msg")))
    assert str(back) == "request 5 | msg"


def test_active_request_count_error_keeps_its_counts_through_pickle():
    back = pickle.loads(pickle.dumps(ActiveRequestCountOverflowError(4, 9)))
    assert (back.max_request_count, back.active_request_count) == (4, 9)
    assert str(back) == "request -- | active_request_count (9) > max_request_count (4)."


def test_pickled_error_can_be_raised_and_caught_as_its_type():
    back = pickle.loads(pickle.dumps(MaxSequenceLengthOverflowError(4, "long")))
    with pytest.raises(MaxSequenceLengthOverflowError, match=r"^request 4 \| long$"):
        raise back
    assert back.is_transient is False


def test_factory_round_trip_then_pickle():
    data = ContextErrorFactory.serialize(TensorStateDeallocatedError(7, "suspended"))
    back = pickle.loads(pickle.dumps(ContextErrorFactory.deserialize(data)))
    assert type(back) is TensorStateDeallocatedError
    assert str(back) == "request 7 | suspended"


@pytest.mark.parametrize("n,text", [(0.0, "0 bytes"), (np.int64(2048), "2 KiB"),
                                    (np.float64(1.5 * 1024 ** 2), "1.5 MiB"),
                                    (1024 ** 5, "1.02e+03 TiB")])
def test_get_mem_size_str_accepts_real_numbers(n, text):
    assert get_mem_size_str(n) == text


@pytest.mark.parametrize("n,match", [
    (math.nan, r"n_bytes=nan must be a finite number"),
    (math.inf, r"n_bytes=inf must be a finite number"),
    (-math.inf, r"n_bytes=-inf must be a finite number"),
    (np.float64("nan"), r"n_bytes=nan must be a finite number"),
    (-1, r"n_bytes=-1 must be >= 0"),
    (-0.5, r"n_bytes=-0.5 must be >= 0"),
])
def test_get_mem_size_str_refuses_values_that_are_not_sizes(n, match):
    with pytest.raises(ValueError, match=match):
        get_mem_size_str(n)


@pytest.mark.parametrize("n", ["1024", None, True, 1 + 2j])
def test_get_mem_size_str_refuses_non_numbers(n):
    with pytest.raises(TypeError, match=r"n_bytes=.* must be a real number of bytes"):
        get_mem_size_str(n)
