#!/usr/bin/env bash
# Runs the suite in two pytest processes: TRITON_INTERPRET is read when kernels are decorated,
# so the interpreter tests need their own process with it set before import.
# -P keeps the working directory off sys.path: the checkout's kernels/, context/, ... folders are
# then importable only as dynctx.* (transformers imports any top-level `kernels` it can find).
# The last line adds both processes up: passed, failed, skipped, ... and how many tests neither
# process selected (the gpu, slow and mcore019 ones).
set -uo pipefail
PY=${1:-python}
# A skip outside the allowlist of tests/conftest.py (SKIP_ALLOWLIST) fails the run.
export DYNCTX_STRICT_SKIPS=1
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
status=0
# mcore019: the ported Megatron-Core 0.19 cases dynctx does not pass yet (strict xfails with
# their reasons, tests/megatron019/dynctx_xfails.py); the ported cases it passes run here.
# tests/megatron019/run_port.py runs all of them against 0.19's source and against dynctx.
"$PY" -P -m pytest -q -m "not interpreter and not gpu and not slow and not mcore019" 2>&1 \
    | tee "$logs/plain" || status=$?
TRITON_INTERPRET=1 "$PY" -P -m pytest -q -m "interpreter" 2>&1 | tee "$logs/interpreter" \
    || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
"$PY" -P - "$logs/plain" "$logs/interpreter" <<'PYEOF'
import re
import sys

# pytest's words in its last line, singular and plural, and the order they are shown in.
WORDS = {"passed": "passed", "failed": "failed", "error": "errors", "errors": "errors",
         "skipped": "skipped", "xfailed": "xfailed", "xpassed": "xpassed",
         "warning": "warnings", "warnings": "warnings", "deselected": "deselected"}
RAN = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
totals, seconds, selected, collected, missing = {}, 0.0, 0, None, []
for path in sys.argv[1:]:
    finals = [line.strip("= ") for line in open(path, errors="replace").read().splitlines()
              if re.search(r" in [0-9.]+s\b", line)]
    if not finals:
        missing.append(path.rsplit("/", 1)[-1])
        continue
    counts = {}
    for number, word in re.findall(r"(\d+) (\w+)", finals[-1].rsplit(" in ", 1)[0]):
        if word in WORDS:
            counts[WORDS[word]] = counts.get(WORDS[word], 0) + int(number)
    for name, number in counts.items():
        totals[name] = totals.get(name, 0) + number
    ran = sum(counts.get(name, 0) for name in RAN)
    selected += ran
    if collected is None:
        collected = ran + counts.get("deselected", 0)
    seconds += float(re.search(r" in ([0-9.]+)s\b", finals[-1]).group(1))
shown = []
for name in (*RAN, "warnings"):
    number = totals.get(name, 0)
    if number or name in ("passed", "failed", "skipped"):
        shown.append(f"{number} {name[:-1] if number == 1 and name.endswith('s') else name}")
if collected is not None:
    shown.append(f"{collected - selected} not run here (gpu, slow, mcore019)")
if missing:
    shown.append(f"no summary from the {' and '.join(missing)} process")
print(f"both pytest processes: {', '.join(shown)} in {seconds:.0f} s")
PYEOF
exit $status
