"""Each ``dynctx::*`` custom op stays registered once, even when a kernel module runs twice.

From a checkout, ``kernels/`` is importable as the top-level package ``kernels`` whenever the
working directory is on ``sys.path``; transformers imports such a ``kernels`` while probing for
the Hugging Face library of that name, which ran every kernel module a second time. Re-registering
an op made torch free the first registration under the module-level ``torch.ops.dynctx.*``
aliases, and the custom-op tests then crashed at random (use-after-free in the dispatcher).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import importlib, sys
    sys.path.insert(0, {root!r})
    import torch, torch.library

    destroyed = []
    original_destroy = torch.library.Library._destroy

    def spy(self):
        if self.ns == "dynctx":
            destroyed.append(sorted(self._op_defs))
        return original_destroy(self)

    torch.library.Library._destroy = spy
    kv = importlib.import_module("dynctx.kernels.kv_append")
    mamba = importlib.import_module("dynctx.kernels.mamba_state")
    importlib.import_module("dynctx.kernels")
    # What transformers' probe for the Hugging Face "kernels" library does, and more: the
    # checkout's folder is imported as a top-level package, every kernel module with it.
    shadow = importlib.import_module("kernels")
    from dynctx.kernels.registry import KERNEL_MODULES
    for module in KERNEL_MODULES:
        importlib.import_module("kernels." + module)
    # The second execution really happened (this is the situation under test).
    assert shadow is not sys.modules["dynctx.kernels"] and "kernels.kv_append" in sys.modules
    assert destroyed == [], f"registrations destroyed: {{destroyed}}"
    assert kv.kv_append_op is torch.ops.dynctx.kv_append

    buffer = torch.zeros(2, 4, 2, 3, 5)
    key, value = torch.randn(3, 3, 5), torch.randn(3, 3, 5)
    block_ids = torch.tensor([0, 1, 3], dtype=torch.int32)
    slots = torch.tensor([1, 0, 1], dtype=torch.int32)
    expected = buffer.clone()
    kv.kv_append_ref(expected[0], expected[1], key, value, block_ids, slots)
    kv.kv_append_op(buffer[0], buffer[1], key, value, block_ids, slots)
    assert torch.equal(buffer, expected)
    states = torch.randn(6, 2, 3)
    ids = torch.tensor([4, 0], dtype=torch.int32)
    assert torch.equal(mamba.mamba_state_gather_op(states, ids), states[[4, 0]])
    torch.library.opcheck(kv.kv_append_op, (buffer[0], buffer[1], key, value, block_ids, slots))
    print("ok")
""")


def test_second_execution_of_kernel_modules_keeps_registrations():
    script = SCRIPT.format(root=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
