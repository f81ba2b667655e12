"""No silent skips (tests/conftest.py): with ``DYNCTX_STRICT_SKIPS=1`` (tests/run_tests.sh sets
it, so CI runs with it) a test or a module that skips for a reason outside ``SKIP_ALLOWLIST``
fails the run; an allowlisted reason and an xfail stay as they are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST_PATH = Path(__file__).parent / "conftest.py"
CONFTEST = CONFTEST_PATH.read_text()
# By path: several test folders have a conftest.py, and the module named ``conftest`` is
# whichever pytest imported last.
_spec = importlib.util.spec_from_file_location("dynctx_tests_conftest", CONFTEST_PATH)
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)
TESTS = '''
import pytest

def test_passes():
    pass

def test_skips_for_a_missing_dependency():
    pytest.importorskip("a_module_that_is_not_installed")

def test_skips_where_the_interpreter_cannot_compute_bf16():
    pytest.skip("the interpreter has no bf16 arithmetic")

@pytest.mark.skipif(True, reason="a guard that no longer holds")
def test_skipped_by_a_mark():
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_a_known_bug():
    assert False
'''


@pytest.fixture
def project(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_cases=TESTS)
    return pytester


def test_strict_mode_fails_every_skip_outside_the_allowlist(project, monkeypatch):
    monkeypatch.setenv(conftest.STRICT_SKIPS_ENV, "1")
    result = project.runpytest_inprocess("-rfEs", "-p", "no:cacheprovider", "-p", "no:benchmark")
    result.assert_outcomes(passed=1, failed=1, errors=1, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines([   # errors (the mark skips in setup) come before failures
        "*skipped for a reason outside the skip allowlist*a guard that no longer holds*",
        "*skipped for a reason outside the skip allowlist*a_module_that_is_not_installed*",
        "SKIPPED*the interpreter has no bf16 arithmetic"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_module_level_skip_is_a_collection_error(project, monkeypatch):
    project.makepyfile(test_module='''
import pytest
pytest.importorskip("a_module_that_is_not_installed")

def test_never_collected():
    pass
''')
    monkeypatch.setenv(conftest.STRICT_SKIPS_ENV, "1")
    result = project.runpytest_inprocess("test_module.py", "-p", "no:cacheprovider", "-p",
                                         "no:benchmark")
    result.stdout.fnmatch_lines(["*ERROR collecting test_module.py*",
                                 "*outside the skip allowlist*a_module_that_is_not_installed*"])
    assert result.ret != pytest.ExitCode.OK


def test_without_strict_mode_skips_stay_skips(project, monkeypatch):
    monkeypatch.delenv(conftest.STRICT_SKIPS_ENV, raising=False)
    result = project.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:benchmark")
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)


def test_every_allowlist_entry_is_named_and_matches_its_reason():
    assert conftest.allowed_skip("the interpreter has no bf16 arithmetic") == \
        "bf16 arithmetic under the interpreter"
    assert conftest.allowed_skip("could not import 'megatron.core'") is None
    assert conftest.skip_reason(("f.py", 3, "Skipped: why")) == "why"
