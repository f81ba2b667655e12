"""tests/run_tests.sh ends with one line adding its pytest processes up (combined_summary)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from combined_summary import combined_line

PLAIN = """\
........................................................................ [ 50%]
......s.                                                                 [100%]
=========================== short test summary info ============================
SKIPPED [1] tests/kernels/test_x.py:3: the interpreter has no bf16 arithmetic
1110 passed, 1 skipped, 445 deselected, 2 warnings in 612.30s (0:10:12)
"""
INTERPRETER = """\
....F..                                                                  [100%]
FAILED tests/kernels/test_y.py::test_z - AssertionError
1 failed, 300 passed, 1 xfailed, 1 warning, 1254 deselected in 300.10s (0:05:00)
"""
STOPPED = """\
ERROR tests/context/test_update_plan_stack.py
!!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!
1211 deselected, 19 warnings, 1 error in 57.12s
"""


SHARD = """\
....                                                                     [100%]
4 passed, 2 deselected in 700.00s (0:11:40)
"""


def test_the_processes_add_up_with_singular_words_and_what_none_ran():
    line = combined_line({"plain": PLAIN, "interpreter": INTERPRETER})
    # 1556 collected (1111 run + 445 deselected in each), 1413 run in both.
    assert line == ("2 pytest processes: 1410 passed, 1 failed, 1 skipped, 1 xfailed, "
                    "3 warnings, 143 not run here (gpu, slow, mcore019); the longest took 612 s")


def test_a_shard_adds_its_tests_and_the_whole_suite_is_counted_once():
    # The shard collected 6 of the 1556 tests the interpreter process collected: 4 more ran.
    line = combined_line({"plain": PLAIN, "plain_e2e": SHARD, "interpreter": INTERPRETER})
    assert line == ("3 pytest processes: 1414 passed, 1 failed, 1 skipped, 1 xfailed, "
                    "3 warnings, 139 not run here (gpu, slow, mcore019); the longest took 700 s")


def test_a_process_without_a_summary_is_named():
    line = combined_line({"plain": PLAIN, "interpreter": "Killed\n"})
    assert line == ("2 pytest processes: 1110 passed, 0 failed, 1 skipped, 2 warnings, no "
                    "summary from the interpreter process; the longest took 612 s")


def test_a_collection_error_is_named_instead_of_a_count_of_tests_not_run():
    line = combined_line({"plain": STOPPED, "interpreter": STOPPED})
    assert line == ("2 pytest processes: 0 passed, 0 failed, 2 errors, 0 skipped, "
                    "38 warnings, the plain process stopped early (Interrupted: 1 error during "
                    "collection), the interpreter process stopped early (Interrupted: 1 error "
                    "during collection); the longest took 57 s")


def test_the_script_prints_the_line_for_log_files(tmp_path):
    (tmp_path / "plain").write_text(PLAIN)
    (tmp_path / "interpreter").write_text(INTERPRETER)
    script = Path(__file__).with_name("combined_summary.py")
    out = subprocess.run([sys.executable, "-P", str(script), str(tmp_path / "plain"),
                          str(tmp_path / "interpreter")], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == [combined_line({"plain": PLAIN, "interpreter": INTERPRETER})]


def test_run_tests_sh_prints_it_last():
    script = (Path(__file__).with_name("run_tests.sh")).read_text()
    calls = [line for line in script.splitlines() if "combined_summary.py" in line
             and not line.startswith("#")]
    assert calls == ['"$PY" -P tests/combined_summary.py "$logs/plain" "$logs/plain_e2e" '
                     '"$logs/interpreter"']
    assert script.rstrip().splitlines()[-2:] == [calls[0], "exit $status"]
