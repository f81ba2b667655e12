"""Triton kernels for every hot path of the dynamic context: launchers only.

Each module holds the ``@triton.jit`` kernel(s), the launcher and a torch reference
``<name>_ref``. Launchers take ``backend=None|"auto"|"triton"|"torch"`` (see ``backend``) and
an optional ``config`` (else the autotune registry resolves one). Importing a module also
registers its launcher as a ``torch.ops.dynctx`` custom op.
"""

from .compaction import compact_requests
from .kv_append import kv_append
from .last_token_logits import last_token_logits, token_log_probs
from .mamba_state import mamba_state_gather, mamba_state_scatter
from .mla_latent import mla_latent_append
from .paged_attention import paged_attention
from .rope import fused_qk_rope
from .rope_kv_append import rope_kv_append
from .speculative_rewind import speculative_rewind
from .step_metadata import step_metadata

__all__ = [
    "compact_requests", "fused_qk_rope", "kv_append", "last_token_logits", "mamba_state_gather",
    "mamba_state_scatter", "mla_latent_append", "paged_attention", "rope_kv_append",
    "speculative_rewind", "step_metadata", "token_log_probs",
]
