"""The Megatron-Core 0.19 port's mode, marker and per-test context (``mcore019_port.py``).

* megatron019 mode (``DYNCTX_MEGATRON019_SRC`` set; ``run_port.py`` sets it): importing
  ``mcore019_port`` here puts the 0.19 source tree first on ``sys.path``, before any test
  module imports ``megatron``.
* The ported files (``PORTED_FILES``) run in CI against dynctx, except the cases that dynctx
  does not pass yet: those are listed in ``dynctx_xfails.XFAILS`` with the reason for each,
  and in dynctx mode are marked ``mcore019`` (which ``tests/run_tests.sh`` deselects) and a
  strict ``xfail`` (``run_port.py`` runs them: one that starts passing fails the run until its
  entry goes). In megatron019 mode nothing is an xfail: every case must pass against 0.19's
  source. The other files here (the pinned ``InferenceConfig`` and block-hash expectations,
  the shim's own tests) run in CI against dynctx, and in megatron019 mode against 0.19's own
  classes.
* Every test of the ported files runs inside ``mcore019_port.held()`` (the CPU shim, in
  megatron019 mode), and after every test the context class's rounders are restored:
  Megatron's prefix-caching tests set them without restoring them, which makes results depend
  on test order.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

# In megatron019 mode this import puts the 0.19 source tree first on sys.path.
from mcore019_port import MODE  # noqa: E402

PORTED_FILES = (
    "test_mcore019_dynamic_context.py",
    "test_mcore019_kv_block_allocator.py",
    "test_mcore019_dynamic_prefix_caching.py",
    "test_mcore019_gpu_view.py",
)
ROUNDER_ATTRS = ("ROUNDER", "TOKEN_ROUNDER", "REQUEST_ROUNDER")
_MISSING = object()


def pytest_configure(config):
    # Megatron-LM marks its tests `internal`; registered so --strict-markers accepts it.
    config.addinivalue_line("markers", "internal: Megatron-LM's marker, kept from the port")


def pytest_collection_modifyitems(config, items):
    from dynctx_xfails import reason_for

    for item in items:
        path = Path(item.path)
        if path.parent != _HERE or path.name not in PORTED_FILES:
            continue
        reason = None if MODE == "megatron019" else reason_for(path.name, item.name,
                                                               item.cls)
        if reason is not None:
            item.add_marker(pytest.mark.mcore019)
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
        # Megatron's request warns once per request built without a termination_id, as the
        # tests build them; 0.19's deprecation shims warn on import.
        item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning"))
        item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
        item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))


@pytest.fixture(autouse=True)
def _mcore019_mode(request):
    """Holds the mode's per-test context (ported files only: the shim's own tests hold it
    themselves) and restores the context class's rounders."""
    from mcore019_port import context_class, held

    cls = context_class()
    saved = {attr: cls.__dict__.get(attr, _MISSING) for attr in ROUNDER_ATTRS}
    ported = Path(request.node.path).name in PORTED_FILES
    try:
        with held() if ported else contextlib.nullcontext():
            yield MODE
    finally:
        for attr, value in saved.items():
            if value is _MISSING:
                if attr in cls.__dict__:
                    delattr(cls, attr)
            else:
                setattr(cls, attr, value)
