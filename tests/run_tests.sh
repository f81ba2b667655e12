#!/usr/bin/env bash
# Runs the suite in two pytest processes: TRITON_INTERPRET is read when kernels are decorated,
# so the interpreter tests need their own process with it set before import.
# -P keeps the working directory off sys.path: the checkout's kernels/, context/, ... folders are
# then importable only as dynctx.* (transformers imports any top-level `kernels` it can find).
# The last line adds both processes up (tests/combined_summary.py): passed, failed, skipped, ...
# and how many tests neither process selected (the gpu, slow and mcore019 ones).
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
"$PY" -P tests/combined_summary.py "$logs/plain" "$logs/interpreter"
exit $status
