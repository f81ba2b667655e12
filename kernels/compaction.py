"""Request-row compaction: apply the host's row plan to the block table and next tokens.

At the end of a step the host decides, for every request row of the next layout, where its
state comes from: finished rows disappear, survivors move into holes, rows swap when requests
pause or resume, evicted rows are cleared, and a resumed request gets one new block. The host
writes that decision as a plan, and ``compact_requests`` applies it in one launch, reading the
old (``src``) buffers and writing the new (``dst``) ones, so that any permutation is safe.

For each destination row ``r < num_rows``, with ``s = plan_src[r]``:

* ``s >= 0``: ``dst_block_table[r] = src_block_table[s]`` and ``dst_next_tokens[r]`` is
  ``new_tokens[s - new_token_offset]`` if ``s >= new_token_offset`` (a row that was active and
  just sampled) else ``src_next_tokens[s]`` (a paused row keeps its pending token);
* ``s < 0``: the row becomes all -1 and its next token 0;
* then, if ``plan_append_col[r] >= 0``, ``dst_block_table[r, plan_append_col[r]] =
  plan_append_block[r]``.

Rows ``[num_rows, clear_rows)`` become all -1 with next token 0; rows from
``max(num_rows, clear_rows)`` on are untouched. Plan values are not checked on the host (that
would sync): the kernel reads nothing out of bounds, a source row outside ``src_block_table``
gives a -1 row and token 0, an append column outside the table is ignored; the reference
raises ``IndexError`` instead.
"""

from __future__ import annotations

import functools

import torch

from . import autotune
from ._common import check_tensor, check_writable, custom_op
from .autotune import KernelConfig, KernelTuning, TuneCase, bucket_tokens
from .backend import HAS_TRITON, resolve_backend
from .devices import same_device
from .launch_plan import CountPlan, KernelLaunch, PlanCache, count_class

# Per launch key (launch_plan.py): the checks passed, the config, the grid, the arguments.
_PLANS = PlanCache("compact_requests")

if HAS_TRITON:
    import triton
    import triton.language as tl

# The dtypes ``new_tokens`` may have: every integer dtype, each widened to int64 in the kernel
# (unsigned ones by zero extension; a uint64 id above 2**63 - 1 would wrap, no vocabulary has one).
NEW_TOKEN_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                    torch.int64, torch.uint64)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_rows", "end_rows", "num_src_rows", "new_token_offset",
                                    "num_new_tokens"])
    def _compact_requests_kernel(
        dst_block_table_ptr, dst_next_tokens_ptr,
        src_block_table_ptr, src_next_tokens_ptr, new_tokens_ptr,
        plan_src_ptr, plan_append_col_ptr, plan_append_block_ptr,
        num_rows, end_rows, num_src_rows, new_token_offset, num_new_tokens, max_blocks,
        stride_dst_row, stride_dst_col, stride_src_row, stride_src_col,
        stride_dst_tokens, stride_src_tokens, stride_new_tokens,
        stride_plan_src, stride_plan_append_col, stride_plan_append_block,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """One [BLOCK_R, BLOCK_C] tile of the new block table; column tile 0 also writes the
        tokens."""
        pid_col = tl.program_id(1)
        offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = pid_col.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_r = offs_r < end_rows
        mask_plan = offs_r < num_rows
        mask_c = offs_c < max_blocks
        # Rows past num_rows (cleared) read the plan as "no source, no append".
        src = tl.load(plan_src_ptr + offs_r * stride_plan_src, mask=mask_plan,
                      other=-1).to(tl.int64)
        has_src = (src >= 0) & (src < num_src_rows)
        append_col = tl.load(plan_append_col_ptr + offs_r * stride_plan_append_col, mask=mask_plan,
                             other=-1).to(tl.int64)
        append_block = tl.load(plan_append_block_ptr + offs_r * stride_plan_append_block,
                               mask=mask_plan, other=-1)
        # [BLOCK_R, BLOCK_C]
        src_ptrs = (src_block_table_ptr + src[:, None] * stride_src_row
                    + offs_c[None, :] * stride_src_col)
        blocks = tl.load(src_ptrs, mask=has_src[:, None] & mask_c[None, :], other=-1)
        blocks = tl.where(offs_c[None, :] == append_col[:, None], append_block[:, None], blocks)
        dst_ptrs = (dst_block_table_ptr + offs_r[:, None] * stride_dst_row
                    + offs_c[None, :] * stride_dst_col)
        tl.store(dst_ptrs, blocks, mask=mask_r[:, None] & mask_c[None, :])
        if pid_col == 0:
            new_index = src - new_token_offset
            from_new = has_src & (new_index >= 0) & (new_index < num_new_tokens)
            from_old = has_src & (new_index < 0)
            # Any integer dtype of new_tokens (uint8 included) widens exactly to int64.
            new = tl.load(new_tokens_ptr + new_index * stride_new_tokens, mask=from_new,
                          other=0).to(tl.int64)
            old = tl.load(src_next_tokens_ptr + src * stride_src_tokens, mask=from_old, other=0)
            tl.store(dst_next_tokens_ptr + offs_r * stride_dst_tokens, tl.where(from_new, new, old),
                     mask=mask_r)


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (0 for an empty tensor): its
    metadata's part of an overlap check, so a launch plan keeps it."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


# The output/input pairs that must not share memory, as indices into the five tensors
# (dst_block_table, src_block_table, dst_next_tokens, src_next_tokens, new_tokens).
_DISJOINT = ((0, 1, "dst_block_table and src_block_table must not share memory"),
             (2, 3, "dst_next_tokens and src_next_tokens must not share memory"),
             (2, 4, "dst_next_tokens and new_tokens must not share memory"))


def _disjoint_pairs(tensors) -> tuple:
    """The pairs of ``_DISJOINT`` that could overlap (on one device, neither empty), each with
    both extents: what the overlap check of a call reads besides the addresses."""
    extents = [_extent(t) for t in tensors]
    return tuple((i, j, extents[i], extents[j], message) for i, j, message in _DISJOINT
                 if extents[i] and extents[j] and same_device(tensors[i].device,
                                                             tensors[j].device))


def _check_disjoint(tensors, pairs) -> None:
    """The outputs share no memory with the inputs: addresses, so checked on every call (a
    launch plan keeps ``pairs``, from the metadata)."""
    for i, j, extent_i, extent_j, message in pairs:
        start_i, start_j = tensors[i].data_ptr(), tensors[j].data_ptr()
        if start_i < start_j + extent_j and start_j < start_i + extent_i:
            raise ValueError(message)


def compact_requests(dst_block_table: torch.Tensor, src_block_table: torch.Tensor,
                     dst_next_tokens: torch.Tensor, src_next_tokens: torch.Tensor,
                     new_tokens: torch.Tensor, plan_src: torch.Tensor,
                     plan_append_col: torch.Tensor, plan_append_block: torch.Tensor, *,
                     new_token_offset: int, num_rows: int, clear_rows: int,
                     config: KernelConfig | None = None, backend: str | None = None,
                     check: bool = True) -> None:
    """Apply a row plan (see the module docstring) in one launch, writing ``dst_*`` in place.

    ``check=False`` skips the argument checks: for a caller (the context) that allocated every
    buffer itself and checked the inputs it was given once, at its own edge.

    Args:
        dst_block_table, src_block_table: int32 ``[max_requests, max_blocks]`` (any strides,
            the same number of columns), distinct memory. ``dst_block_table[:max(num_rows,
            clear_rows)]`` is written.
        dst_next_tokens, src_next_tokens: int64 ``[max_requests]`` (any stride), distinct memory;
            ``dst_next_tokens[:max(num_rows, clear_rows)]`` is written.
        new_tokens: ``[A_old]`` of any integer dtype (``NEW_TOKEN_DTYPES``: signed and unsigned,
            8 to 64 bits) and any stride or storage offset (``sampled[:, 0]`` works), the tokens
            just sampled, one per previously active row (source rows ``new_token_offset + k``).
            Every dtype is widened to int64 in the kernel, with no copy; bool, float and complex
            dtypes are refused before anything is written.
        plan_src, plan_append_col, plan_append_block: int32 ``[>= num_rows]``, any stride.
        new_token_offset: host int, source rows below it take their token from
            ``src_next_tokens``.
        num_rows, clear_rows: host ints; rows ``[num_rows, clear_rows)`` are cleared.

    Every tensor is read or written through its own strides and storage offset; nothing is
    copied at the edge. Every argument is checked before anything is written: a refused call
    leaves ``dst_*`` untouched.
    """
    # The counts by class (the config's bucket), their launches per value in the plan
    # (launch_plan.CountPlan, _vary_rows).
    counts = (new_token_offset, num_rows, clear_rows)
    plan, plan_key = _PLANS.find(
        (dst_block_table, src_block_table, dst_next_tokens, src_next_tokens, new_tokens, plan_src,
         plan_append_col, plan_append_block),
        (*_row_classes(new_token_offset, num_rows, clear_rows), check, backend), config,
        backend=backend)
    launch = None if plan is None else plan.launch_for(counts, ())
    if launch is not None:
        if plan.extra:
            _check_disjoint((dst_block_table, src_block_table, dst_next_tokens, src_next_tokens,
                             new_tokens), plan.extra)
        launch.launch((dst_block_table, dst_next_tokens, src_block_table, src_next_tokens,
                       new_tokens, plan_src, plan_append_col, plan_append_block))
        return
    device = dst_block_table.device if isinstance(dst_block_table, torch.Tensor) else None
    num_rows, clear_rows, new_token_offset = int(num_rows), int(clear_rows), int(new_token_offset)
    end_rows = max(num_rows, clear_rows)
    # The overlap checks a plan of this key makes on every call (none without check).
    pairs = ()
    if check:
        check_tensor("dst_block_table", dst_block_table, dims=2, dtypes=(torch.int32,),
                     device=device, device_of="dst_block_table")
        check_tensor("src_block_table", src_block_table, dims=2, dtypes=(torch.int32,),
                     device=device, device_of="dst_block_table")
        check_tensor("dst_next_tokens", dst_next_tokens, dims=1, dtypes=(torch.int64,),
                     device=device, device_of="dst_block_table")
        check_tensor("src_next_tokens", src_next_tokens, dims=1, dtypes=(torch.int64,),
                     device=device, device_of="dst_block_table")
        check_tensor("new_tokens", new_tokens, dims=1, dtypes=NEW_TOKEN_DTYPES, device=device,
                     device_of="dst_block_table")
        for name, plan in (("plan_src", plan_src), ("plan_append_col", plan_append_col),
                           ("plan_append_block", plan_append_block)):
            check_tensor(name, plan, dims=1, dtypes=(torch.int32,), device=device,
                         device_of="dst_block_table")
            if plan.numel() < num_rows:
                raise ValueError(f"{name} has {plan.numel()} entries, num_rows={num_rows}")
        check_writable(("dst_block_table", dst_block_table), ("dst_next_tokens", dst_next_tokens))
        if src_block_table.shape[1] != dst_block_table.shape[1]:
            raise ValueError(f"src_block_table has {src_block_table.shape[1]} columns, "
                             f"dst_block_table {dst_block_table.shape[1]}")
        pairs = _disjoint_pairs((dst_block_table, src_block_table, dst_next_tokens,
                                 src_next_tokens, new_tokens))
        _check_disjoint((dst_block_table, src_block_table, dst_next_tokens, src_next_tokens,
                         new_tokens), pairs)
        if num_rows < 0 or clear_rows < 0:
            raise ValueError(f"num_rows={num_rows} and clear_rows={clear_rows} must be >= 0")
        if end_rows > dst_block_table.shape[0]:
            raise ValueError(f"dst_block_table has {dst_block_table.shape[0]} rows, "
                             f"num_rows/clear_rows need {end_rows}")
        if end_rows > dst_next_tokens.shape[0]:
            raise ValueError(f"dst_next_tokens has {dst_next_tokens.shape[0]} entries, "
                             f"num_rows/clear_rows need {end_rows}")
        if not 0 <= new_token_offset <= src_next_tokens.shape[0]:
            raise ValueError(f"new_token_offset={new_token_offset} must be in [0, "
                             f"{src_next_tokens.shape[0]}] (src_next_tokens entries)")
    if resolve_backend(backend, device) == "torch":
        compact_requests_ref(dst_block_table, src_block_table, dst_next_tokens, src_next_tokens,
                             new_tokens, plan_src, plan_append_col, plan_append_block,
                             new_token_offset=new_token_offset, num_rows=num_rows,
                             clear_rows=clear_rows)
        return
    max_blocks = dst_block_table.shape[1]
    if end_rows == 0:
        return
    if config is None:
        key = compact_requests_tune_key(max_blocks=max_blocks, num_rows=end_rows)
        config, _ = autotune.resolve_config("compact_requests", key, device)
    meta = config.kwargs
    # At least one column tile: column tile 0 writes the tokens, a table without columns too.
    grid = (triton.cdiv(end_rows, meta["BLOCK_R"]),
            max(1, triton.cdiv(max_blocks, meta["BLOCK_C"])))
    pointers = dict(
        dst_block_table_ptr=dst_block_table, dst_next_tokens_ptr=dst_next_tokens,
        src_block_table_ptr=src_block_table, src_next_tokens_ptr=src_next_tokens,
        new_tokens_ptr=new_tokens, plan_src_ptr=plan_src, plan_append_col_ptr=plan_append_col,
        plan_append_block_ptr=plan_append_block)
    launch = KernelLaunch(_compact_requests_kernel, grid, dict(
        **pointers, num_rows=num_rows, end_rows=end_rows, num_src_rows=src_block_table.shape[0],
        new_token_offset=new_token_offset, num_new_tokens=new_tokens.shape[0],
        max_blocks=max_blocks,
        stride_dst_row=dst_block_table.stride(0), stride_dst_col=dst_block_table.stride(1),
        stride_src_row=src_block_table.stride(0), stride_src_col=src_block_table.stride(1),
        stride_dst_tokens=dst_next_tokens.stride(0), stride_src_tokens=src_next_tokens.stride(0),
        stride_new_tokens=new_tokens.stride(0), stride_plan_src=plan_src.stride(0),
        stride_plan_append_col=plan_append_col.stride(0),
        stride_plan_append_block=plan_append_block.stride(0),
        **config.launch_kwargs()), pointers)
    # The counts the checks let through for this key (any, without checks).
    limits = None if not check else (
        min(dst_block_table.shape[0], dst_next_tokens.shape[0]), src_next_tokens.shape[0],
        min(entries.numel() for entries in (plan_src, plan_append_col, plan_append_block)))
    _PLANS.put(plan_key, CountPlan(counts, launch, functools.partial(_vary_rows, launch, limits),
                                   pairs))


def _row_classes(new_token_offset, num_rows, clear_rows) -> tuple:
    """The plan key's stand-in for the counts: the bucket of the rows written (the config's),
    or the counts themselves where one is not a plain int >= 0. Every call asks, mostly with
    the last call's count objects: the last answer is kept for them."""
    global _LAST_CLASSES
    last = _LAST_CLASSES
    if num_rows is last[0] and clear_rows is last[1] and new_token_offset is last[2]:
        return last[3]
    classes = (new_token_offset, num_rows, clear_rows)
    if (type(new_token_offset) is type(num_rows) is type(clear_rows) is int and num_rows >= 0
            and clear_rows >= 0):
        classes = (count_class(max(num_rows, clear_rows)),)
    # (One tuple, read and written whole: another thread sees this answer or the last.)
    _LAST_CLASSES = (num_rows, clear_rows, new_token_offset, classes)
    return classes


_LAST_CLASSES = (None,) * 4


def _vary_rows(launch, limits, counts: tuple, tensors: tuple):
    """A plan's launch for other counts: its rows' grid and count arguments where the checks
    let them through (``limits``: rows written, source tokens, plan entries), else None (the
    full path refuses them)."""
    new_token_offset, num_rows, clear_rows = counts
    if not type(new_token_offset) is type(num_rows) is type(clear_rows) is int:
        return None
    end_rows = max(num_rows, clear_rows)
    if limits is not None and not (0 <= num_rows <= limits[2] and 0 <= clear_rows
                                   and end_rows <= limits[0]
                                   and 0 <= new_token_offset <= limits[1]):
        return None
    grid = (triton.cdiv(end_rows, launch.kwargs["BLOCK_R"]), *launch.grid[1:])
    return launch.varied(grid, num_rows=num_rows, end_rows=end_rows,
                         new_token_offset=new_token_offset)


def compact_requests_ref(dst_block_table: torch.Tensor, src_block_table: torch.Tensor,
                         dst_next_tokens: torch.Tensor, src_next_tokens: torch.Tensor,
                         new_tokens: torch.Tensor, plan_src: torch.Tensor,
                         plan_append_col: torch.Tensor, plan_append_block: torch.Tensor, *,
                         new_token_offset: int, num_rows: int, clear_rows: int) -> None:
    """Torch reference of ``compact_requests``: gather every new row, then write them all."""
    src = plan_src[:num_rows].long()
    has_src = src >= 0
    # The token each source row carries into the next step: paused rows keep theirs, the rows
    # that were active take the one just sampled (Megatron's cat(paused_tokens, new_tokens)),
    # and one trailing 0 serves the rows without a source.
    carried_tokens = torch.cat([src_next_tokens[:new_token_offset], new_tokens.long(),
                                src_next_tokens.new_zeros(1)])
    no_source = carried_tokens.numel() - 1

    rows = torch.where(has_src[:, None], src_block_table[src.clamp(min=0)], -1)
    tokens = carried_tokens[torch.where(has_src, src, no_source)]
    append_col = plan_append_col[:num_rows].long()
    has_append = append_col >= 0
    if rows.shape[1]:   # (a table without columns: the tokens only, as the kernel)
        safe_col = append_col.clamp(min=0)[:, None]
        kept = rows.gather(1, safe_col)
        rows.scatter_(1, safe_col,
                      torch.where(has_append[:, None], plan_append_block[:num_rows, None], kept))

    dst_block_table[:num_rows] = rows
    dst_next_tokens[:num_rows] = tokens
    dst_block_table[num_rows:clear_rows] = -1
    dst_next_tokens[num_rows:clear_rows] = 0


_BLOCK_ROWS = (1, 4, 16)


_BLOCK_COLS = (64, 128, 256)


_WARPS = (1, 4)


def compact_requests_configs(key: dict) -> list[KernelConfig]:
    return [KernelConfig.make(BLOCK_R=r, BLOCK_C=c, num_warps=w)
            for r in _BLOCK_ROWS for c in _BLOCK_COLS for w in _WARPS]


def compact_requests_default_config(key: dict) -> KernelConfig:
    block_cols = next((c for c in _BLOCK_COLS if c >= key["max_blocks"]), _BLOCK_COLS[-1])
    return KernelConfig.make(BLOCK_R=4, BLOCK_C=block_cols, num_warps=4)


def compact_requests_tune_key(*, max_blocks: int, num_rows: int) -> dict:
    return {"max_blocks": int(max_blocks), "num_rows": bucket_tokens(num_rows)}


class _CompactionCase(TuneCase):
    """A step end with ``num_rows`` live rows: a few paused rows keep their token, the rest are
    permuted active rows with holes, and every fourth row gets a block appended."""

    def __init__(self, key: dict, device: torch.device):
        rows, max_blocks = key["num_rows"], key["max_blocks"]
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.src_block_table = torch.randint(0, 1 << 20, (rows, max_blocks), generator=gen,
                                             dtype=torch.int32).to(device)
        self.dst_block_table = torch.full_like(self.src_block_table, -1)
        self.src_next_tokens = torch.randint(0, 1 << 16, (rows,), generator=gen).to(device)
        self.dst_next_tokens = torch.zeros_like(self.src_next_tokens)
        self.new_token_offset = rows // 8
        num_new_tokens = rows - self.new_token_offset
        self.new_tokens = torch.randint(0, 1 << 16, (num_new_tokens,), generator=gen).to(device)
        plan_src = torch.randperm(rows, generator=gen).to(torch.int32)
        plan_src[::7] = -1
        append_col = torch.where(torch.arange(rows) % 4 == 0,
                                 torch.randint(0, max_blocks, (rows,), generator=gen), -1)
        self.plan_src = plan_src.to(device)
        self.plan_append_col = append_col.to(torch.int32).to(device)
        self.plan_append_block = torch.randint(0, 1 << 20, (rows,), generator=gen,
                                               dtype=torch.int32).to(device)
        self.num_rows = rows
        self.bytes_moved = 2 * rows * max_blocks * 4 + rows * (3 * 4 + 3 * 8)

    def _call(self, dst_block_table, dst_next_tokens, config, backend):
        compact_requests(dst_block_table, self.src_block_table, dst_next_tokens,
                         self.src_next_tokens, self.new_tokens, self.plan_src,
                         self.plan_append_col, self.plan_append_block,
                         new_token_offset=self.new_token_offset, num_rows=self.num_rows,
                         clear_rows=self.num_rows, config=config, backend=backend)

    def run(self, config: KernelConfig) -> None:
        self._call(self.dst_block_table, self.dst_next_tokens, config, "triton")

    def run_reference(self) -> None:
        self._call(self.dst_block_table, self.dst_next_tokens, None, "torch")

    def check(self, config: KernelConfig) -> None:
        expected_table = torch.full_like(self.dst_block_table, -7)
        expected_tokens = torch.full_like(self.dst_next_tokens, -7)
        self._call(expected_table, expected_tokens, None, "torch")
        self.dst_block_table.fill_(-7)
        self.dst_next_tokens.fill_(-7)
        self.run(config)
        assert torch.equal(self.dst_block_table, expected_table), f"{config}: block table differs"
        assert torch.equal(self.dst_next_tokens, expected_tokens), f"{config}: next tokens differ"


def _compaction_presets() -> list[dict]:
    return [compact_requests_tune_key(max_blocks=b, num_rows=r)
            for b in (128, 256) for r in (64, 256, 1024)]


autotune.register(KernelTuning(
    name="compact_requests", configs=compact_requests_configs,
    default_config=compact_requests_default_config, tune_key=compact_requests_tune_key,
    token_field="num_rows", make_case=_CompactionCase, presets=_compaction_presets))


@custom_op("dynctx::compact_requests", mutates_args=("dst_block_table", "dst_next_tokens"))
def _compact_requests_op(dst_block_table: torch.Tensor, src_block_table: torch.Tensor,
                         dst_next_tokens: torch.Tensor, src_next_tokens: torch.Tensor,
                         new_tokens: torch.Tensor, plan_src: torch.Tensor,
                         plan_append_col: torch.Tensor, plan_append_block: torch.Tensor,
                         new_token_offset: int, num_rows: int, clear_rows: int) -> None:
    compact_requests(dst_block_table, src_block_table, dst_next_tokens, src_next_tokens,
                     new_tokens, plan_src, plan_append_col, plan_append_block,
                     new_token_offset=new_token_offset, num_rows=num_rows, clear_rows=clear_rows)


@_compact_requests_op.register_fake
def _(dst_block_table, src_block_table, dst_next_tokens, src_next_tokens, new_tokens, plan_src,
      plan_append_col, plan_append_block, new_token_offset, num_rows, clear_rows):
    return None
