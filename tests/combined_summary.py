"""The last line of tests/run_tests.sh: its pytest processes added up.

``python tests/combined_summary.py LOG...`` (a log per process, named by its file name) prints
one line such as ``3 pytest processes: 1210 passed, 0 failed, 0 skipped, 345 not run here (gpu,
slow, mcore019); the longest took 612 s``: passed, failed and skipped always, errors, xfailed,
xpassed and warnings when there are any, how many collected tests no process selected, which
process left no pytest summary (it crashed or was killed) and which stopped early (a collection
error). The processes run side by side, so the time shown is the longest one's. Shards collect
parts of the suite and the interpreter process all of it: the largest selected plus deselected
count of one process is the number collected.
"""

from __future__ import annotations

import re
import sys
from typing import Dict, Optional

#: pytest's words in its last line, singular and plural, mapped to one name each.
WORDS = {"passed": "passed", "failed": "failed", "error": "errors", "errors": "errors",
         "skipped": "skipped", "xfailed": "xfailed", "xpassed": "xpassed",
         "warning": "warnings", "warnings": "warnings", "deselected": "deselected"}
#: The outcomes of tests that ran, in pytest's order.
RAN = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
FINAL = re.compile(r" in ([0-9.]+)s\b")
#: pytest's line when it stopped early (a collection error, ``-x``, Ctrl-C).
INTERRUPTED = re.compile(r"^!+ (Interrupted: .*?) !+$", re.M)


def final_counts(log: str) -> Optional[tuple]:
    """``(counts, seconds)`` from pytest's last summary line in ``log``, or None without one."""
    finals = [line.strip("= ") for line in log.splitlines() if FINAL.search(line)]
    if not finals:
        return None
    counts: Dict[str, int] = {}
    for number, word in re.findall(r"(\d+) (\w+)", finals[-1].rsplit(" in ", 1)[0]):
        if word in WORDS:
            counts[WORDS[word]] = counts.get(WORDS[word], 0) + int(number)
    return counts, float(FINAL.search(finals[-1]).group(1))


def combined_line(logs: Dict[str, str]) -> str:
    """The one line for the logs of the processes, keyed by their names (``plain``, ...)."""
    totals: Dict[str, int] = {}
    seconds, selected, collected, missing, stopped = 0.0, 0, 0, [], []
    for name, log in logs.items():
        interrupted = INTERRUPTED.search(log)
        if interrupted:
            stopped.append(f"the {name} process stopped early ({interrupted.group(1)})")
        found = final_counts(log)
        if found is None:
            missing.append(name)
            continue
        counts, took = found
        for word, number in counts.items():
            totals[word] = totals.get(word, 0) + number
        ran = sum(counts.get(word, 0) for word in RAN)
        selected += ran
        collected = max(collected, ran + counts.get("deselected", 0))
        seconds = max(seconds, took)
    shown = []
    for word in (*RAN, "warnings"):
        number = totals.get(word, 0)
        if number or word in ("passed", "failed", "skipped"):
            shown.append(f"{number} {word[:-1] if number == 1 and word.endswith('s') else word}")
    if not missing and not stopped:
        shown.append(f"{collected - selected} not run here (gpu, slow, mcore019)")
    if missing:
        shown.append(f"no summary from the {' and '.join(missing)} process")
    shown += stopped
    return (f"{len(logs)} pytest processes: {', '.join(shown)}; the longest took "
            f"{seconds:.0f} s")


if __name__ == "__main__":
    paths = sys.argv[1:]
    print(combined_line({path.rsplit("/", 1)[-1]: open(path, errors="replace").read()
                         for path in paths}))
