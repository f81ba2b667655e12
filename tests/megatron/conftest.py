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

#: (test name, is_hybrid_model or None) -> (the exception the dynctx run fails with first,
#: one sentence per difference that makes it fail). xfail(raises=...) turns any other failure
#: into an error. Empty: every dynctx run passes (docs/SEMANTICS.md §16 lists how dynctx meets
#: the tests: lazy step arrays, write-through bookkeeping views on a CPU device, ...).
DYNCTX_XFAIL: dict = {}


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
