import os
import re

import pytest

# Test helper modules (megatron_oracle, interpreter_bounds, tolerances, ...) live in this folder
# and import as top-level modules: pyproject's [tool.pytest.ini_options] `pythonpath` puts it on
# sys.path. tests/ is deliberately not a package (that would put the repository root on sys.path
# and make the checkout's kernels/, context/ folders importable under bare names).

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    import interpreter_bounds

    interpreter_bounds.install()


# ---------------------------------------------------------------- no silent skips
#: The only reasons a test may skip when ``DYNCTX_STRICT_SKIPS=1`` (tests/run_tests.sh, i.e. CI,
#: sets it): name -> a pattern the skip reason must match. Any other skip (a missing test
#: dependency such as megatron-core, a guard that no longer holds) fails the run, so that a
#: broken install cannot turn checks into skips while the suite stays green.
SKIP_ALLOWLIST = {
    # numpy has no bfloat16: the interpreter's bf16 arithmetic is garbage (CONTRIBUTING.md,
    # "The Triton interpreter's limits"); those cases run compiled on the GPU machine.
    "bf16 arithmetic under the interpreter": r"the interpreter has no bf16 arithmetic",
}
STRICT_SKIPS_ENV = "DYNCTX_STRICT_SKIPS"


def skip_reason(longrepr) -> str:
    """The reason of a skipped report (pytest keeps ``(path, line, "Skipped: reason")``)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def allowed_skip(reason: str):
    """The allowlist entry ``reason`` matches, or None."""
    for name, pattern in SKIP_ALLOWLIST.items():
        if re.search(pattern, reason):
            return name
    return None


def _strict() -> bool:
    return os.environ.get(STRICT_SKIPS_ENV, "0") not in ("", "0")


def _refuse_skip(report) -> None:
    """Turn a skipped report whose reason is not allowlisted into a failure."""
    if not report.skipped or hasattr(report, "wasxfail") or not _strict():
        return
    reason = skip_reason(report.longrepr)
    if allowed_skip(reason) is None:
        report.outcome = "failed"
        report.longrepr = (f"skipped for a reason outside the skip allowlist "
                           f"(tests/conftest.py SKIP_ALLOWLIST, {STRICT_SKIPS_ENV}=1): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _refuse_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _refuse_skip(outcome.get_result())
