import os

# Test helper modules (megatron_oracle, interpreter_bounds, tolerances, ...) live in this folder
# and import as top-level modules: pyproject's [tool.pytest.ini_options] `pythonpath` puts it on
# sys.path. tests/ is deliberately not a package (that would put the repository root on sys.path
# and make the checkout's kernels/, context/ folders importable under bare names).

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    import interpreter_bounds

    interpreter_bounds.install()
