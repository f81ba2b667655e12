"""The tolerances the tests hold the arithmetic kernels to (data movement is compared bit for bit).

They live here, not in ``kernels/``: a kernel file states its contract and its tune-time
acceptance check; how close a test demands the kernel be to its reference is the tests' call.
"""

from __future__ import annotations

import torch

# Log-softmax (last_token_logits with log_softmax, token_log_probs): fp32 throughout, an online
# max/sum over tiles against torch's one-pass log_softmax.
LOG_SOFTMAX_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def rope_tolerance(expected: torch.Tensor, dtype: torch.dtype, input_scale: float) -> torch.Tensor:
    """Allowed |kernel - fp32 reference|: one ulp of ``dtype`` at the reference value (covers
    round-to-nearest on a GPU and the interpreter's truncation to bf16), plus 8 fp32 eps times
    the input scale for fp32 cos/sin and FMA differences."""
    mantissa = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype]
    exponent = torch.frexp(expected.float()).exponent
    ulp = torch.ldexp(torch.ones_like(expected, dtype=torch.float32), exponent - 1 - mantissa)
    ulp = torch.where(expected == 0, torch.zeros_like(ulp), ulp)
    return ulp + 8 * torch.finfo(torch.float32).eps * input_scale


def assert_rope_close(actual: torch.Tensor, expected: torch.Tensor, input_scale: float,
                      name: str = "output") -> None:
    """``actual`` (any float dtype) within ``rope_tolerance`` of the fp32 ``expected``."""
    error = (actual.float() - expected.float()).abs()
    allowed = rope_tolerance(expected, actual.dtype, input_scale)
    bad = ~(error <= allowed)
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} elements differ, first at "
                             f"{index}: {float(actual[index])} vs {float(expected[index])} "
                             f"(allowed {float(allowed[index]):.3g})")
