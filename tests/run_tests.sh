#!/usr/bin/env bash
# Runs the suite in two pytest processes: TRITON_INTERPRET is read when kernels are decorated,
# so the interpreter tests need their own process with it set before import.
# -P keeps the working directory off sys.path: the checkout's kernels/, context/, ... folders are
# then importable only as dynctx.* (transformers imports any top-level `kernels` it can find).
set -uo pipefail
PY=${1:-python}
# A skip outside the allowlist of tests/conftest.py (SKIP_ALLOWLIST) fails the run.
export DYNCTX_STRICT_SKIPS=1
cd "$(dirname "$0")/.."
status=0
"$PY" -P -m pytest -q -m "not interpreter and not gpu and not slow" || status=$?
TRITON_INTERPRET=1 "$PY" -P -m pytest -q -m "interpreter" || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
exit $status
