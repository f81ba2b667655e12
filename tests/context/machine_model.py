"""The state machine's ground: small context configurations, the request model the driver
keeps, and how an invariant fails.

``MachineConfig`` sizes a small fp32 context (plain, MLA or hybrid Mamba + attention);
``Tracked`` is the driver's own view of one request incarnation (what it believes the context
holds: query, cached tokens, blocks, Mamba slot); ``require`` raises ``Violation`` when an
invariant does not hold. ``sample_token`` and ``expected_metadata`` are the deterministic
"model" outputs and per-request sampling fields the driver feeds the context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from helpers import GIB

from dynctx.context import (
    DynamicInferenceContext,
    DynamicInferenceRequest,
    MambaInferenceStateConfig,
)

VOCAB = 1000                 # token ids of prompts and samples lie in [0, VOCAB)
TERMINATION_BASE = 10 ** 6   # termination ids are never sampled
WAITING_LIMIT = 8            # rejected fitting requests wait (up to this many) and are re-tried
_EXACT = 2 ** 24             # integers below this are exact in fp32


HYBRID_LAYERS = ("M", "*", "-", "M", "*")  # Mamba layers 1 and 4, attention layers 2 and 5
_POISON = 0.5                # never a pattern value: states of free slots and padded scatter rows
PREFIX_SNAPSHOTS = 6         # hybrids with prefix caching: Mamba state snapshots


class Violation(AssertionError):
    """An invariant of the context does not hold."""


def require(condition, message) -> None:
    if not condition:
        raise Violation(message() if callable(message) else message)


@dataclass(frozen=True)
class MachineConfig:
    """A small fp32 context. ``paused_blocks=None`` uses the default half split at
    ``unified_memory_level=0``; otherwise ``paused_buffer_size_gb`` is that many blocks.
    ``layer_types`` (``*`` attention, ``M`` Mamba, ``-`` MLP) makes it a hybrid with Mamba
    states of ``conv_shape`` and ``ssm_shape``; ``num_layers`` is then ignored."""

    name: str
    block_size: int = 4
    buffer_blocks: int = 16
    paused_blocks: Optional[int] = 4
    mla: bool = False
    max_sequence_length: int = 40
    max_tokens: int = 32
    max_requests: int = 8
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 4
    kv_lora_rank: int = 8
    rope_dim: int = 4
    layer_types: Optional[Tuple[str, ...]] = None
    conv_shape: Tuple[int, ...] = (3, 2)
    ssm_shape: Tuple[int, ...] = (2, 2, 3)
    # Prefix caching: the eviction policy ("ref_zero" or "lru"), None: off. Prompts then come
    # from two token families, so that they share prefixes.
    prefix_caching: Optional[str] = None
    # Hybrids with prefix caching: the Mamba state snapshots the budget buys (1: a tiny budget,
    # several snapshots of one update compete for it).
    prefix_snapshots: int = PREFIX_SNAPSHOTS
    # Speculative steps (docs/SEMANTICS.md §19): a decode request forwards its pending token and
    # this many drafts; the driver accepts a chosen number of them and rewinds the rest.
    speculative: int = 0
    # With speculative steps: each update gives every row its own draft count (0..k; rows
    # resumed from the paused ones forward none), so steps are plain, ragged or uniform.
    draft_counts: bool = False
    # KV offload (docs/SEMANTICS.md §21): host blocks for evicted requests (0: off); an
    # evicted request re-added with its saved tokens restores them instead of recomputing.
    kv_offload_blocks: int = 0
    # KV groups (docs/SEMANTICS.md §22): each attention layer's window (None: full).
    windows: Optional[Tuple[Optional[int], ...]] = None
    # False where no request can pause: every layer windowed, the windows' worst cases within
    # the buffer (group 0's blocks then never run short).
    pauses: bool = True
    # Token rewinds (docs/SEMANTICS.md §19, ``rewind_tokens``): each step drops a chosen number
    # of decode rows' generated tokens, across earlier steps and blocks (k = 0, no hybrid, no
    # KV groups: where the context allows it).
    token_rewinds: bool = False

    @property
    def hybrid(self) -> bool:
        return self.layer_types is not None

    @property
    def host_tier(self) -> bool:
        """Prefix caching with a host pool: the prefix cache's host tier (docs/SEMANTICS.md
        §21) spills its cached blocks (and a hybrid's snapshots) there and restores them;
        never with KV groups (§22), whose windows keep no host tier."""
        return (self.prefix_caching is not None and self.kv_offload_blocks > 0
                and self.windows is None)

    @property
    def total_layers(self) -> int:
        return len(self.layer_types) if self.hybrid else self.num_layers

    @property
    def attention_layers(self) -> List[int]:
        """Global 1-based numbers of the attention layers."""
        if not self.hybrid:
            return list(range(1, self.num_layers + 1))
        return [i + 1 for i, kind in enumerate(self.layer_types) if kind == "*"]

    @property
    def mamba_layers(self) -> List[int]:
        """Global 1-based numbers of the Mamba layers."""
        if not self.hybrid:
            return []
        return [i + 1 for i, kind in enumerate(self.layer_types) if kind == "M"]

    @property
    def mamba_bytes(self) -> int:
        return 4 * len(self.mamba_layers) * (math.prod(self.conv_shape)
                                             + math.prod(self.ssm_shape))

    @property
    def block_bytes(self) -> int:
        """Bytes per block, including the one request's Mamba state a hybrid budgets per block."""
        layers = len(self.attention_layers)
        if self.mla:
            return 4 * layers * self.block_size * (self.kv_lora_rank + self.rope_dim)
        return (4 * 2 * layers * self.block_size * self.num_heads * self.head_dim
                + self.mamba_bytes)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def make_context(self) -> DynamicInferenceContext:
        args = dict(params_dtype=torch.float32, num_layers=self.total_layers,
                    kv_channels=self.head_dim, num_attention_heads=self.num_heads,
                    max_sequence_length=self.max_sequence_length,
                    buffer_size_gb=self.buffer_blocks * self.block_bytes / GIB,
                    block_size_tokens=self.block_size, max_tokens=self.max_tokens,
                    max_requests=self.max_requests, unified_memory_level=0, device="cpu",
                    num_speculative_tokens=self.speculative)
        if self.paused_blocks is not None:
            args["paused_buffer_size_gb"] = self.paused_blocks * self.block_bytes / GIB
        if self.windows is not None:
            args["kv_layer_windows"] = list(self.windows)
        if self.mla:
            args.update(cache_mla_latent=True, kv_lora_rank=self.kv_lora_rank,
                        qk_pos_emb_head_dim=self.rope_dim)
        if self.hybrid:
            args["mamba_inference_state_config"] = MambaInferenceStateConfig(
                self.layer_types, self.conv_shape, self.ssm_shape)
        if self.prefix_caching is not None:
            args.update(enable_prefix_caching=True,
                        prefix_caching_eviction_policy=self.prefix_caching)
            if self.hybrid:
                # Room for ``prefix_snapshots`` Mamba state snapshots.
                args["prefix_caching_mamba_gb"] = self.prefix_snapshots * self.mamba_bytes / GIB
        if self.kv_offload_blocks:
            args["kv_offload_gb"] = self.kv_offload_blocks * self.block_bytes / GIB
        ctx = DynamicInferenceContext(**args)
        # A request that pauses alone must be able to resume, or no request could ever run.
        max_blocks = math.ceil(self.max_sequence_length / self.block_size)
        if ctx.block_allocator.active_count < max_blocks:
            raise ValueError(f"config {self.name}: {ctx.block_allocator.active_count} active "
                             f"blocks cannot hold one request of {max_blocks} blocks")
        return ctx


CONFIGS = {c.name: c for c in [
    MachineConfig("bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4),
    MachineConfig("bs8-half", block_size=8, buffer_blocks=24, paused_blocks=None),
    MachineConfig("bs4-paused0", block_size=4, buffer_blocks=14, paused_blocks=0),
    MachineConfig("mla-bs8-paused3", block_size=8, buffer_blocks=12, paused_blocks=3, mla=True),
    MachineConfig("bs4-half", block_size=4, buffer_blocks=24, paused_blocks=None),
    MachineConfig("mla-bs4-half", block_size=4, buffer_blocks=24, paused_blocks=None, mla=True),
    MachineConfig("hyb-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  layer_types=HYBRID_LAYERS),
    MachineConfig("hyb-bs8-half", block_size=8, buffer_blocks=24, paused_blocks=None,
                  layer_types=HYBRID_LAYERS, conv_shape=(4, 3), ssm_shape=(2, 3, 2)),
    MachineConfig("hyb-bs4-paused0", block_size=4, buffer_blocks=14, paused_blocks=0,
                  layer_types=("*", "M", "-"), conv_shape=(2, 2), ssm_shape=(1, 2, 2)),
    MachineConfig("pc-lru-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  prefix_caching="lru"),
    MachineConfig("pc-refzero-bs4-half", block_size=4, buffer_blocks=24, paused_blocks=None,
                  prefix_caching="ref_zero"),
    MachineConfig("pc-lru-mla-bs8-half", block_size=8, buffer_blocks=24, paused_blocks=None,
                  mla=True, prefix_caching="lru"),
    MachineConfig("pc-hyb-lru-bs4-half", block_size=4, buffer_blocks=24, paused_blocks=None,
                  layer_types=HYBRID_LAYERS, prefix_caching="lru"),
    MachineConfig("pc-hyb-refzero-bs4-paused4", block_size=4, buffer_blocks=16,
                  paused_blocks=4, layer_types=HYBRID_LAYERS, prefix_caching="ref_zero"),
    MachineConfig("pc-hyb-lru-bs4-snap1", block_size=4, buffer_blocks=24, paused_blocks=None,
                  layer_types=HYBRID_LAYERS, prefix_caching="lru", prefix_snapshots=1),
    # Speculative steps: 1 + k tokens a decode request, blocks taken early, drafts rewound.
    MachineConfig("spec2-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  speculative=2),
    MachineConfig("spec3-mla-bs8-paused3", block_size=8, buffer_blocks=12, paused_blocks=3,
                  mla=True, speculative=3),
    MachineConfig("spec1-hyb-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  layer_types=HYBRID_LAYERS, speculative=1),
    MachineConfig("spec2-pc-lru-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  prefix_caching="lru", speculative=2),
    MachineConfig("spec3-counts-bs8-paused3", block_size=8, buffer_blocks=12, paused_blocks=3,
                  speculative=3, draft_counts=True),
    MachineConfig("spec2-counts-hyb-pc-lru-bs4-half", block_size=4, buffer_blocks=24,
                  paused_blocks=None, layer_types=HYBRID_LAYERS, prefix_caching="lru",
                  speculative=2, draft_counts=True),
    MachineConfig("off-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  kv_offload_blocks=12),
    MachineConfig("off-tiny-bs4-paused0", block_size=4, buffer_blocks=14, paused_blocks=0,
                  kv_offload_blocks=3),
    MachineConfig("off-mla-bs8-paused3", block_size=8, buffer_blocks=12, paused_blocks=3,
                  mla=True, kv_offload_blocks=8),
    MachineConfig("off-hyb-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  layer_types=HYBRID_LAYERS, kv_offload_blocks=12),
    # Speculative steps with KV offload: a paused row's KV may end mid-block, and a restore
    # brings back exactly its accepted tokens.
    MachineConfig("spec2-off-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  speculative=2, kv_offload_blocks=12),
    MachineConfig("spec1-off-hyb-bs4-paused4", block_size=4, buffer_blocks=16,
                  paused_blocks=4, layer_types=HYBRID_LAYERS, speculative=1,
                  kv_offload_blocks=12),
    MachineConfig("spec2-off-pc-lru-bs4-paused4", block_size=4, buffer_blocks=16,
                  paused_blocks=4, prefix_caching="lru", speculative=2, kv_offload_blocks=40),
    # The prefix cache's host tier: idle cached blocks spill to the host pool and come back
    # (shared with the swapped requests; the small pools drop spilled blocks for room).
    MachineConfig("off-pc-lru-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  prefix_caching="lru", kv_offload_blocks=40),
    MachineConfig("off-pc-refzero-bs4-half", block_size=4, buffer_blocks=24,
                  paused_blocks=None, prefix_caching="ref_zero", kv_offload_blocks=12),
    MachineConfig("off-pc-lru-mla-bs4-paused4", block_size=4, buffer_blocks=16,
                  paused_blocks=4, mla=True, prefix_caching="lru", kv_offload_blocks=40),
    MachineConfig("off-pc-hyb-lru-bs4-snap1", block_size=4, buffer_blocks=16, paused_blocks=4,
                  layer_types=HYBRID_LAYERS, prefix_caching="lru", prefix_snapshots=1,
                  kv_offload_blocks=12),
    MachineConfig("spec3-pc-hyb-lru-bs4-half", block_size=4, buffer_blocks=24,
                  paused_blocks=None, layer_types=HYBRID_LAYERS, prefix_caching="lru",
                  speculative=3),
    # KV groups: windowed groups release the blocks their windows no longer read.
    MachineConfig("kvg-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  num_layers=3, windows=(5, None, 9)),
    MachineConfig("kvg-bs8-half", block_size=8, buffer_blocks=24, paused_blocks=None,
                  windows=(None, 6)),
    # Every layer windowed: group 0 holds no layers. Eight rows are more than the windows'
    # worst cases fit in the buffer, so group 0 keeps its budgets (pauses, evictions); two
    # rows fit, and group 0's blocks then never limit a request.
    MachineConfig("kvw-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  windows=(5, 9)),
    MachineConfig("kvw-fit-bs4-half", block_size=4, buffer_blocks=16, paused_blocks=None,
                  max_requests=2, max_tokens=16, num_layers=3, windows=(6, 6, 9),
                  pauses=False),
    # KV groups with prefix caching: a hit needs the blocks each window reads from its end.
    MachineConfig("kvg-pc-lru-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  num_layers=3, windows=(5, None, 9), prefix_caching="lru"),
    MachineConfig("kvw-pc-refzero-bs4-half", block_size=4, buffer_blocks=24,
                  paused_blocks=None, windows=(6, 10), prefix_caching="ref_zero"),
    # KV groups with speculative steps: each window keeps k more tokens (the rewind's).
    MachineConfig("kvg-spec2-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  num_layers=3, windows=(5, None, 9), speculative=2),
    MachineConfig("kvw-spec3-pc-lru-bs8-half", block_size=8, buffer_blocks=24,
                  paused_blocks=None, windows=(6, 11), speculative=3, prefix_caching="lru"),
    # KV groups with KV offload: each group keeps its own host copies (the windows' tails).
    MachineConfig("kvg-off-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  num_layers=3, windows=(5, None, 9), kv_offload_blocks=12),
    MachineConfig("kvw-off-pc-lru-bs4-paused0", block_size=4, buffer_blocks=14,
                  paused_blocks=0, windows=(6, 10), kv_offload_blocks=6, prefix_caching="lru"),
    MachineConfig("kvw-pc-lru-fit-bs4", block_size=4, buffer_blocks=24, paused_blocks=4,
                  max_requests=4, max_tokens=16, windows=(6, 6), prefix_caching="lru",
                  pauses=False),
    # Token rewinds: rows shrink across blocks, then pause, resume and are evicted again.
    MachineConfig("rw-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  token_rewinds=True),
    MachineConfig("rw-pc-lru-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  prefix_caching="lru", token_rewinds=True),
    MachineConfig("rw-off-bs4-paused0", block_size=4, buffer_blocks=14, paused_blocks=0,
                  kv_offload_blocks=12, token_rewinds=True),
]}
CI_CONFIGS = [CONFIGS[n] for n in ("bs4-paused4", "bs8-half", "bs4-paused0", "mla-bs8-paused3",
                                   "hyb-bs4-paused4", "hyb-bs8-half", "pc-lru-bs4-paused4",
                                   "pc-hyb-lru-bs4-half", "spec2-bs4-paused4",
                                   "spec1-hyb-bs4-paused4", "spec2-pc-lru-bs4-paused4",
                                   "spec3-counts-bs8-paused3",
                                   "off-bs4-paused4", "off-tiny-bs4-paused0",
                                   "off-hyb-bs4-paused4", "kvg-bs4-paused4",
                                   "off-pc-lru-bs4-paused4", "off-pc-hyb-lru-bs4-snap1",
                                   "kvw-pc-lru-fit-bs4", "kvg-spec2-bs4-paused4",
                                   "kvw-off-pc-lru-bs4-paused0", "rw-pc-lru-bs4-paused4")]


def sample_token(rid: int, position: int) -> int:
    """The token the model 'samples' for request ``rid`` after ``position`` tokens."""
    return (rid * 131 + position * 17 + 7) % VOCAB


def expected_metadata(rid: int) -> Dict[str, float]:
    """Per-request sampling metadata, distinct per id, so that rows moving without their
    metadata are caught (exact in fp32)."""
    return dict(temperature=((rid % 7) + 1) / 4, top_k=rid % 50, top_p=(rid % 5) / 4,
                termination_id=TERMINATION_BASE + rid, return_log_probs=rid % 2 == 0,
                skip_prompt_log_probs=rid % 3 == 0, top_n_logprobs=rid % 3)


@dataclass(eq=False)
class Tracked:
    """The engine's view of one request incarnation (an eviction or suspend makes a new one)."""

    rid: int
    uid: int                      # keys the K/V pattern: a recompute writes new values
    prompt: List[int]
    gen: int
    req: DynamicInferenceRequest
    generated: List[int] = field(default_factory=list)
    query_start: int = 0          # position of the first token of the pending query
    query: List[int] = field(default_factory=list)  # token ids of the pending query
    cached: int = 0               # tokens whose K/V are in the cache
    prefill: bool = True          # the pending query is a prompt chunk
    chunking: bool = False        # a non-final chunk is in the context
    placeholder: bool = False     # the pending query is the junk token after a non-final chunk
    paused: bool = False
    blocks: List[int] = field(default_factory=list)  # block ids seen at the last check
    slot: int = -1                # hybrids: the Mamba slot it got when added (never changes)
    mamba_writes: int = 0         # hybrids: steps whose Mamba state pattern it holds
    mamba_len: int = 0            # hybrids with prefix caching: tokens its state absorbed
    continued: bool = False       # the pending query is a continuation chunk (added this step)
    shared: int = 0               # prefix caching: the first chunk's tokens in shared blocks
    drafts: List[int] = field(default_factory=list)  # speculative: the query's tokens after
    #                               the pending one (its drafts, not yet generated)
    kept_drafts: List[int] = field(default_factory=list)  # all k drafts the device keeps
    next_drafts: int = -1         # speculative: the drafts its next step forwards (-1: k)
    # KV offload: an evicted incarnation's (uid, cached tokens, Mamba writes, Mamba length),
    # which a restore carries over (its K/V and Mamba patterns are the old incarnation's).
    restore: Optional[tuple] = None

    def expected_blocks(self, block_size: int) -> int:
        if self.paused or self.placeholder:
            return math.ceil(self.cached / block_size)
        return math.ceil((self.query_start + len(self.query)) / block_size)


