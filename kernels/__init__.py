"""Triton kernels for every hot path of the dynamic context: launchers only.

Each module holds the ``@triton.jit`` kernel(s), the launcher and a torch reference
``<name>_ref``. Launchers take ``backend=None|"auto"|"triton"|"torch"`` (see ``_backend``).
"""

__all__: list[str] = []
