"""The ``impl`` fixture of the ported Megatron-Core tests, and the dynctx differences still open.

Every test in this folder runs twice: against megatron-core 0.16.1 on the CPU (``megatron``) and
against dynctx (``dynctx``); ``mcore_port.py`` says how. A dynctx run listed in
``DYNCTX_XFAIL`` is marked ``xfail(strict=True)`` with the difference that makes it fail: the
suite stays green while the difference exists and turns red (XPASS) the day it is fixed, so the
entry must then be removed. The megatron runs are never marked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_port import IMPLS, load_impl

_HERE = Path(__file__).resolve().parent

#: The differences (one sentence each) that make dynctx runs fail.
_HAND_WRITES = ("the test writes the bookkeeping tensors by hand (request ids, query lengths, "
                "block counts, block-table rows) and calls update_requests; dynctx's host "
                "arrays are authoritative and never see the writes, so nothing is released")

#: (test name, is_hybrid_model or None) -> (the exception the dynctx run fails with first,
#: every difference that makes it fail). xfail(raises=...) turns any other failure into an error.
DYNCTX_XFAIL: dict = {
    ("test_update_request", False): (AssertionError, _HAND_WRITES),
    ("test_update_request", True): (AssertionError, _HAND_WRITES),
    ("test_release_memory_blocks_for_finished_requests", False): (AssertionError, _HAND_WRITES),
    ("test_release_memory_blocks_for_finished_requests", True): (AssertionError, _HAND_WRITES),
    ("test_finished_requests_with_multiple_blocks", False): (AssertionError, _HAND_WRITES),
    ("test_finished_requests_with_multiple_blocks", True): (AssertionError, _HAND_WRITES),
}


def pytest_configure(config):
    # Megatron-LM marks these tests `internal`; registered here so --strict-markers accepts it.
    config.addinivalue_line("markers", "internal: Megatron-LM's marker, kept from the port")


def pytest_collection_modifyitems(config, items):
    # The hook sees every item of the session: only this folder's are touched.
    for item in items:
        if Path(item.path).parent != _HERE:
            continue
        # Megatron's request warns once per request built without a termination_id, as the
        # tests build them.
        item.add_marker(pytest.mark.filterwarnings(
            "ignore:DynamicInferenceRequest .* has no termination_id:UserWarning"))
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("impl") != "dynctx":
            continue
        key = (item.originalname, callspec.params.get("is_hybrid_model"))
        entry = DYNCTX_XFAIL.get(key)
        if entry is not None:
            raises, reason = entry
            item.add_marker(pytest.mark.xfail(strict=True, raises=raises,
                                              reason=f"dynctx: {reason}"))


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Binds the test module's implementation names for one test and holds what it needs."""
    chosen = load_impl(request.param)
    for name, value in chosen.names().items():
        monkeypatch.setattr(request.module, name, value)
    with chosen.running():
        yield chosen
