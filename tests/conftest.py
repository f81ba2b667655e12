import os
import sys

# Test helper modules (megatron_oracle, ...) live in this folder: make them importable from
# every test subfolder as top-level modules.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    import interpreter_bounds

    interpreter_bounds.install()
