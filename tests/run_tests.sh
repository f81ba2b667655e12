#!/usr/bin/env bash
# Runs the suite in three pytest processes: TRITON_INTERPRET is read when kernels are decorated,
# so the interpreter tests need their own process with it set before import, and the plain
# tests run in two shards side by side.
# -P keeps the working directory off sys.path: the checkout's kernels/, context/, ... folders are
# then importable only as dynctx.* (transformers imports any top-level `kernels` it can find).
# The last line adds the processes up (tests/combined_summary.py): passed, failed, skipped, ...
# and how many tests no process selected (the gpu, slow and mcore019 ones).
set -uo pipefail
PY=${1:-python}
# A skip outside the allowlist of tests/conftest.py (SKIP_ALLOWLIST) fails the run.
export DYNCTX_STRICT_SKIPS=1
# One torch thread a process (the processes share the cores); a caller's setting wins.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
status=0
# mcore019: the ported Megatron-Core 0.19 cases dynctx does not pass yet (strict xfails with
# their reasons, tests/megatron019/dynctx_xfails.py); the ported cases it passes run here.
# tests/megatron019/run_port.py runs all of them against 0.19's source and against dynctx.
PLAIN="not interpreter and not gpu and not slow and not mcore019"
# Three pytest processes: the plain tests in two shards (tests/e2e, the model runs, beside
# the rest), the interpreter after the second shard, so that two cores stay busy. The e2e
# shard writes its log, printed when it ends; the other two print as they go.
"$PY" -P -m pytest -q -m "$PLAIN" tests/e2e >"$logs/plain_e2e" 2>&1 &
e2e=$!
"$PY" -P -m pytest -q -m "$PLAIN" --ignore=tests/e2e 2>&1 | tee "$logs/plain" || status=$?
TRITON_INTERPRET=1 "$PY" -P -m pytest -q -m "interpreter" 2>&1 | tee "$logs/interpreter" \
    || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
wait "$e2e" || status=$?
echo "=== the plain process of tests/e2e ==="
cat "$logs/plain_e2e"
"$PY" -P tests/combined_summary.py "$logs/plain" "$logs/plain_e2e" "$logs/interpreter"
exit $status
