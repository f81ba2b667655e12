"""Marks shared by the tests that run the Triton kernels themselves."""

import pytest
import torch

from dynctx.kernels import backend

#: Skips a test that needs the Triton kernels to run: compiled on CUDA, or under the CPU
#: interpreter (``TRITON_INTERPRET=1`` set before import, as tests/run_tests.sh does).
needs_triton = pytest.mark.skipif(
    not (backend.triton_interpreting() or torch.cuda.is_available()),
    reason="needs TRITON_INTERPRET=1 set before import (tests/run_tests.sh) or a CUDA device")
