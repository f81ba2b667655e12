"""dynctx: a dynamic inference context (paged KV cache + in-flight batching) with Triton kernels.

Subpackages: ``dynctx.kernels`` (Triton kernels, launchers and torch references),
``dynctx.context`` (the ``DynamicInferenceContext``), ``dynctx.models`` (model adapters),
``dynctx.engine`` (a small reference engine).
"""

__version__ = "0.1.0"
