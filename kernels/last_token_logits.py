"""Last-token logits gather and token log-probabilities.

``last_token_logits`` picks each request's last-token row of the step's logits
(``logits[cu_query_lengths[i + 1] - 1]``), bit-exact in every dtype, or its fp32 log-softmax.
``token_log_probs`` gives ``log_softmax(logits[t].float())[token_ids[t]]`` for every token, and
optionally the whole fp32 log-softmax, in one launch: one program per row keeps a running max
and sum of exponentials over ``BLOCK_V`` tiles of the vocabulary, then reads the row once more
to write the full log-softmax when asked.

Index values are never checked on the host (that would sync): a ``cu_query_lengths`` entry
that points outside the logits gives a NaN row, an out-of-range token id a NaN log-prob. The
torch references raise ``IndexError`` instead.
"""

from __future__ import annotations

import torch

from . import autotune
from ._common import FLOAT_DTYPES, check_writable, custom_op
from ._shapes import LLAMA_3_8B
from .autotune import KernelConfig, KernelTuning, TuneCase, bucket_tokens, dtype_name
from .backend import HAS_TRITON, resolve_backend
from .devices import same_device
from .launch_plan import CountPlan, KernelLaunch, PlanCache, count_class

# Per launch key (launch_plan.py): checks passed, config, grid, arguments, outputs' shapes.
_LAST_TOKEN_PLANS, _LOG_PROB_PLANS = PlanCache("last_token_logits"), PlanCache("token_log_probs")

if HAS_TRITON:
    import triton
    import triton.language as tl


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_tokens"])
    def _last_token_gather_kernel(
        out_ptr, logits_ptr, cu_query_lengths_ptr,
        num_tokens, vocab_size,
        stride_out_row, stride_out_col, stride_logits_row, stride_logits_col, stride_cu,
        BLOCK_V: tl.constexpr,
    ):
        """out[i, tile] = logits[cu_query_lengths[i + 1] - 1, tile]; a row outside the logits
        gives NaN."""
        request = tl.program_id(0).to(tl.int64)
        offs_v = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < vocab_size
        row = tl.load(cu_query_lengths_ptr + (request + 1) * stride_cu).to(tl.int64) - 1
        mask_row = (row >= 0) & (row < num_tokens)
        # tl.where, not `&`: a scalar & vector mask loses its bool dtype under the interpreter.
        mask_load = tl.where(mask_row, mask_v, False)
        values = tl.load(logits_ptr + row * stride_logits_row + offs_v * stride_logits_col,
                         mask=mask_load, other=float("nan"))
        tl.store(out_ptr + request * stride_out_row + offs_v * stride_out_col, values, mask=mask_v)

    @triton.heuristics({
        "GATHER_LAST": lambda args: args["cu_query_lengths_ptr"] is not None,
        "WRITE_FULL": lambda args: args["full_ptr"] is not None,
        "PICK_TOKEN": lambda args: args["token_log_probs_ptr"] is not None,
    })
    @triton.jit(do_not_specialize=["num_tokens"])
    def _row_log_softmax_kernel(
        full_ptr, token_log_probs_ptr,
        logits_ptr,
        cu_query_lengths_ptr, token_ids_ptr,
        num_tokens, vocab_size,
        stride_full_row, stride_full_col, stride_token_log_probs,
        stride_logits_row, stride_logits_col, stride_cu, stride_token_ids,
        BLOCK_V: tl.constexpr, GATHER_LAST: tl.constexpr, WRITE_FULL: tl.constexpr,
        PICK_TOKEN: tl.constexpr,
    ):
        """fp32 log-softmax of one row (row i, or row cu[i + 1] - 1): online max and sum-exp."""
        program = tl.program_id(0).to(tl.int64)
        if GATHER_LAST:
            row = tl.load(cu_query_lengths_ptr + (program + 1) * stride_cu).to(tl.int64) - 1
        else:
            row = program
        mask_row = (row >= 0) & (row < num_tokens)
        row_ptr = logits_ptr + row * stride_logits_row
        offs = tl.arange(0, BLOCK_V)
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.full((), 0.0, tl.float32)
        # While loops, not range(): Triton 3.6's interpreter cannot take runtime bounds there.
        start = 0
        while start < vocab_size:
            mask_v = tl.where(mask_row, start + offs < vocab_size, False)
            # Upcast at once: fp32 arithmetic only (the interpreter has no bf16 arithmetic).
            x = tl.load(row_ptr + (start + offs) * stride_logits_col, mask=mask_v,
                        other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = (running_sum * tl.exp(running_max - new_max)
                           + tl.sum(tl.exp(x - new_max), axis=0))
            running_max = new_max
            start += BLOCK_V
        # An invalid row has max -inf and sum 0: its log-sum-exp is NaN, and so is every output.
        log_sum_exp = running_max + tl.log(running_sum)
        if PICK_TOKEN:
            token = tl.load(token_ids_ptr + program * stride_token_ids).to(tl.int64)
            mask_token = (token >= 0) & (token < vocab_size) & mask_row
            x_token = tl.load(row_ptr + token * stride_logits_col, mask=mask_token,
                              other=float("nan")).to(tl.float32)
            tl.store(token_log_probs_ptr + program * stride_token_log_probs, x_token - log_sum_exp)
        if WRITE_FULL:
            out_row_ptr = full_ptr + program * stride_full_row
            start = 0
            while start < vocab_size:
                mask_v = start + offs < vocab_size
                mask_load = tl.where(mask_row, mask_v, False)
                x = tl.load(row_ptr + (start + offs) * stride_logits_col, mask=mask_load,
                            other=0.0).to(tl.float32)
                tl.store(out_row_ptr + (start + offs) * stride_full_col, x - log_sum_exp,
                         mask=mask_v)
                start += BLOCK_V


def _check_logits(logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"logits of 3 dims must be [1, T, V], got {tuple(logits.shape)}")
        logits = logits[0]
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V] or [1, T, V], got {tuple(logits.shape)}")
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    return logits


def _check_out(out: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype,
               device: torch.device, name: str = "out") -> None:
    if tuple(out.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {out.dtype}")
    if not same_device(out.device, device):
        raise ValueError(f"{name} is on {out.device}, logits on {device}")
    check_writable((name, out))


def last_token_logits(logits: torch.Tensor, cu_query_lengths: torch.Tensor, num_requests: int, *,
                      log_softmax: bool = False, out: torch.Tensor | None = None,
                      config: KernelConfig | None = None,
                      backend: str | None = None) -> torch.Tensor:
    """Gather each request's last-token row of the logits.

    Args:
        logits: ``[T, V]`` or ``[1, T, V]``, float32/float16/bfloat16, any strides (a
            transposed view works; a contiguous last dim is the fast case).
        cu_query_lengths: int32 ``[>= num_requests + 1]`` on the logits' device, any stride;
            request ``i`` owns tokens ``[cu[i], cu[i + 1])``.
        num_requests: host int, the number of rows to return.
        log_softmax: return the fp32 log-softmax of each row instead of the row itself.
        out: optional ``[num_requests, V]`` output (logits' dtype, or float32 with
            ``log_softmax``; any strides), written in place and returned.

    Every tensor is read or written through its own strides and storage offset; nothing is
    copied at the edge. Every argument is checked before anything is written.

    Returns ``[num_requests, V]``: row ``i`` is ``logits[cu_query_lengths[i + 1] - 1]``, bit-exact
    (or its fp32 log-softmax).
    """
    plan, plan_key = _LAST_TOKEN_PLANS.find((logits, cu_query_lengths, out), (  # (by bucket)
        count_class(num_requests), log_softmax, backend), config, backend=backend)
    launch = None if plan is None else plan.launch_for(num_requests, ())
    if launch is not None:
        if out is None:
            out = logits.new_empty((num_requests, plan.extra[0]), dtype=plan.extra[1])
        launch.launch((out, logits, cu_query_lengths))
        return out
    logits = _check_logits(logits)
    if not isinstance(cu_query_lengths, torch.Tensor) or cu_query_lengths.dim() != 1:
        raise ValueError("cu_query_lengths must be a 1-D int32 tensor")
    if cu_query_lengths.dtype != torch.int32:
        raise ValueError(f"cu_query_lengths must be int32, got {cu_query_lengths.dtype}")
    if not same_device(cu_query_lengths.device, logits.device):
        raise ValueError(f"cu_query_lengths is on {cu_query_lengths.device}, "
                         f"logits on {logits.device}")
    num_requests = int(num_requests)
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests} must be >= 0")
    if cu_query_lengths.numel() < num_requests + 1:
        raise ValueError(f"cu_query_lengths has {cu_query_lengths.numel()} entries; "
                         f"num_requests={num_requests} needs {num_requests + 1}")
    num_tokens, vocab_size = logits.shape
    out_dtype = torch.float32 if log_softmax else logits.dtype
    if out is not None:
        _check_out(out, (num_requests, vocab_size), out_dtype, logits.device)
    if resolve_backend(backend, logits.device) == "torch":
        rows = last_token_logits_ref(logits, cu_query_lengths, num_requests,
                                     log_softmax=log_softmax)
        return rows if out is None else out.copy_(rows)
    # The counts a plan of this key takes (launch_plan.CountPlan): cu_query_lengths' (out's).
    rows = (num_requests,) * 2 if out is not None else (1, cu_query_lengths.numel() - 1)
    if out is None:
        out = torch.empty(num_requests, vocab_size, dtype=out_dtype, device=logits.device)
    if num_requests == 0 or vocab_size == 0:
        return out
    if config is None:
        key = last_token_logits_tune_key(vocab_size=vocab_size, dtype=logits.dtype,
                                          num_requests=num_requests, log_softmax=log_softmax)
        config, _ = autotune.resolve_config("last_token_logits", key, logits.device)
    if log_softmax:
        pointers = dict(full_ptr=out, logits_ptr=logits, cu_query_lengths_ptr=cu_query_lengths)
        launch = KernelLaunch(_row_log_softmax_kernel, (num_requests,), dict(
            **pointers, token_log_probs_ptr=None, token_ids_ptr=None, num_tokens=num_tokens,
            vocab_size=vocab_size,
            stride_full_row=out.stride(0), stride_full_col=out.stride(1), stride_token_log_probs=0,
            stride_logits_row=logits.stride(0), stride_logits_col=logits.stride(1),
            stride_cu=cu_query_lengths.stride(0), stride_token_ids=0,
            **config.launch_kwargs()), pointers)
    else:
        grid = (num_requests, triton.cdiv(vocab_size, config.kwargs["BLOCK_V"]))
        pointers = dict(out_ptr=out, logits_ptr=logits, cu_query_lengths_ptr=cu_query_lengths)
        launch = KernelLaunch(_last_token_gather_kernel, grid, dict(
            **pointers, num_tokens=num_tokens, vocab_size=vocab_size,
            stride_out_row=out.stride(0), stride_out_col=out.stride(1),
            stride_logits_row=logits.stride(0), stride_logits_col=logits.stride(1),
            stride_cu=cu_query_lengths.stride(0),
            **config.launch_kwargs()), pointers)
    _LAST_TOKEN_PLANS.put(plan_key, CountPlan.first_axis(num_requests, launch, *rows,
                                                         extra=(vocab_size, out.dtype)))
    return out


def token_log_probs(logits: torch.Tensor, token_ids: torch.Tensor, *, return_full: bool = False,
                    config: KernelConfig | None = None, backend: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of one chosen token per row, in one launch.

    Args:
        logits: ``[T, V]`` or ``[1, T, V]``, float32/float16/bfloat16, any strides.
        token_ids: ``[T]`` int32/int64 on the logits' device, any stride or storage offset
            (``sampled[:, 0]`` works), each in ``[0, V)`` (not checked on the host; an
            out-of-range id gives NaN).
        return_full: also return the full fp32 log-softmax.

    Every input is read through its own strides; nothing is copied at the edge.

    Returns ``(log_probs, full)``: fp32 ``[T]`` with
    ``log_softmax(logits[t].float())[token_ids[t]]`` and, when ``return_full``, fp32 ``[T, V]``
    (else ``None``). Both are newly allocated.
    """
    plan, plan_key = _LOG_PROB_PLANS.find((logits, token_ids), (return_full, backend),
                                          config, backend=backend)
    if plan is not None:
        launch, num_tokens, vocab_size = plan
        log_probs = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
        full = (torch.empty(num_tokens, vocab_size, dtype=torch.float32, device=logits.device)
                if return_full else None)
        launch.launch((full, log_probs, logits, token_ids))
        return log_probs, full
    logits = _check_logits(logits)
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        raise ValueError("token_ids must be a 1-D int32/int64 tensor")
    if token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_ids must be int32 or int64, got {token_ids.dtype}")
    if not same_device(token_ids.device, logits.device):
        raise ValueError(f"token_ids is on {token_ids.device}, logits on {logits.device}")
    num_tokens, vocab_size = logits.shape
    if token_ids.shape[0] != num_tokens:
        raise ValueError(f"token_ids has {token_ids.shape[0]} entries, logits {num_tokens} rows")
    if resolve_backend(backend, logits.device) == "torch":
        return token_log_probs_ref(logits, token_ids, return_full=return_full)
    log_probs = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
    full = (torch.empty(num_tokens, vocab_size, dtype=torch.float32, device=logits.device)
            if return_full else None)
    if num_tokens == 0:
        return log_probs, full
    if config is None:
        key = token_log_probs_tune_key(vocab_size=vocab_size, dtype=logits.dtype,
                                       num_tokens=num_tokens, return_full=return_full)
        config, _ = autotune.resolve_config("token_log_probs", key, logits.device)
    pointers = dict(full_ptr=full, token_log_probs_ptr=log_probs, logits_ptr=logits,
                    token_ids_ptr=token_ids)
    launch = KernelLaunch(_row_log_softmax_kernel, (num_tokens,), dict(
        **pointers, cu_query_lengths_ptr=None, num_tokens=num_tokens, vocab_size=vocab_size,
        stride_full_row=full.stride(0) if full is not None else 0,
        stride_full_col=full.stride(1) if full is not None else 0,
        stride_token_log_probs=log_probs.stride(0),
        stride_logits_row=logits.stride(0), stride_logits_col=logits.stride(1),
        stride_cu=0, stride_token_ids=token_ids.stride(0),
        **config.launch_kwargs()), pointers)
    _LOG_PROB_PLANS.put(plan_key, (launch, num_tokens, vocab_size))
    return log_probs, full


def last_token_logits_ref(logits: torch.Tensor, cu_query_lengths: torch.Tensor,
                          num_requests: int, *, log_softmax: bool = False) -> torch.Tensor:
    """Torch reference of ``last_token_logits`` (returns a new tensor)."""
    if logits.dim() == 3:
        logits = logits[0]
    last_rows = cu_query_lengths[1:num_requests + 1].long() - 1
    rows = logits[last_rows]
    if log_softmax:
        return torch.log_softmax(rows.float(), dim=-1)
    return rows


def token_log_probs_ref(logits: torch.Tensor, token_ids: torch.Tensor, *, return_full: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of ``token_log_probs``."""
    if logits.dim() == 3:
        logits = logits[0]
    full = torch.log_softmax(logits.float(), dim=-1)
    log_probs = full.gather(1, token_ids.long()[:, None])[:, 0]
    return log_probs, (full if return_full else None)


# A tune case's acceptance bound for a log-softmax config (the tests state their own tolerance
# in tests/tolerances.py).
_TUNE_CHECK_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


# Search spaces: the gather is a copy of BLOCK_V-wide tiles; the log-softmax walks the row.
_GATHER_BLOCKS = (1024, 2048, 4096, 8192)


_GATHER_WARPS = (4, 8)


# One program walks a whole row, so at a few rows the walk's latency dominates and the widest
# tiles win (H200, V = 128256: 16384 x 16 warps beat 4096 x 8 by 1.3x; num_stages changed nothing).
_SOFTMAX_BLOCKS = (4096, 8192, 16384, 32768)


_SOFTMAX_WARPS = (4, 8, 16)


def _softmax_configs() -> list[KernelConfig]:
    # At most 128 values of a tile per thread: more spill on sm_90 (32768 at 4 warps).
    return [KernelConfig.make(BLOCK_V=b, num_warps=w)
            for b in _SOFTMAX_BLOCKS for w in _SOFTMAX_WARPS if b <= 4096 * w]


def _softmax_default(vocab_size: int) -> KernelConfig:
    if vocab_size >= 16384:
        return KernelConfig.make(BLOCK_V=16384, num_warps=16)
    return KernelConfig.make(BLOCK_V=4096 if vocab_size <= 4096 else 8192, num_warps=8)


def last_token_logits_configs(key: dict) -> list[KernelConfig]:
    if key.get("log_softmax"):
        return _softmax_configs()
    return [KernelConfig.make(BLOCK_V=b, num_warps=w)
            for b in _GATHER_BLOCKS for w in _GATHER_WARPS]


def last_token_logits_default_config(key: dict) -> KernelConfig:
    if key.get("log_softmax"):
        return _softmax_default(key["vocab_size"])
    return KernelConfig.make(BLOCK_V=4096 if key["vocab_size"] >= 4096 else 1024, num_warps=4)


def last_token_logits_tune_key(*, vocab_size: int, dtype: torch.dtype, num_requests: int,
                               log_softmax: bool = False) -> dict:
    return {"vocab_size": int(vocab_size), "dtype": dtype_name(dtype),
            "num_requests": bucket_tokens(num_requests), "log_softmax": bool(log_softmax)}


def token_log_probs_configs(key: dict) -> list[KernelConfig]:
    return _softmax_configs()


def token_log_probs_default_config(key: dict) -> KernelConfig:
    return _softmax_default(key["vocab_size"])


def token_log_probs_tune_key(*, vocab_size: int, dtype: torch.dtype, num_tokens: int,
                             return_full: bool = False) -> dict:
    return {"vocab_size": int(vocab_size), "dtype": dtype_name(dtype),
            "num_tokens": bucket_tokens(num_tokens), "return_full": bool(return_full)}


def scaled_down_key(key: dict) -> dict:
    """A committed key made small enough for the interpreter: at most 4 rows and a 9000-entry
    vocabulary (several tiles for every block size; no search space depends on either)."""
    small = {**key, "vocab_size": min(key["vocab_size"], 9000)}
    for field in ("num_requests", "num_tokens"):
        if field in small:
            small[field] = min(small[field], 4)
    return small


class _LogitsCase(TuneCase):
    """Scratch logits of a decode step: ``rows`` requests of one token each (or ``rows`` tokens)."""

    def __init__(self, key: dict, device: torch.device, *, rows: int, last_token: bool):
        self.key = key
        self.last_token = last_token
        vocab = key["vocab_size"]
        dtype = getattr(torch, key["dtype"])
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.logits = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(device)
        self.cu_query_lengths = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.token_ids = torch.randint(0, vocab, (rows,), generator=gen).to(device)
        self.rows = rows
        out_dtype = torch.float32 if key.get("log_softmax") else dtype
        self.out = torch.empty(rows, vocab, dtype=out_dtype, device=device) if last_token else None
        item = self.logits.element_size()
        if last_token and not key["log_softmax"]:
            self.bytes_moved = 2 * rows * vocab * item
        else:
            full = key.get("log_softmax") or key.get("return_full")
            # One read for the running max/sum, one more and an fp32 write for the full row.
            self.bytes_moved = (rows * vocab * item * (2 if full else 1)
                                + (rows * vocab * 4 if full else 0))

    def _call(self, config, backend, out=None):
        if self.last_token:
            return (last_token_logits(self.logits, self.cu_query_lengths, self.rows,
                                      log_softmax=self.key["log_softmax"], out=out, config=config,
                                      backend=backend), None)
        return token_log_probs(self.logits, self.token_ids, return_full=self.key["return_full"],
                               config=config, backend=backend)

    def run(self, config: KernelConfig) -> None:
        self._call(config, "triton", self.out)

    def run_reference(self) -> None:
        self._call(None, "torch", self.out)

    def check(self, config: KernelConfig) -> None:
        if self.out is not None:
            self.out.fill_(float("nan"))
        got, expected = self._call(config, "triton", self.out), self._call(None, "torch")
        exact = self.last_token and not self.key["log_softmax"]
        for g, e in zip(got, expected):
            if e is None:
                continue
            if exact:
                assert torch.equal(g, e), f"{config}: gathered rows differ from the reference"
            else:
                torch.testing.assert_close(g, e, **_TUNE_CHECK_TOLERANCE)


def _last_token_case(key: dict, device: torch.device) -> TuneCase:
    return _LogitsCase(key, device, rows=key["num_requests"], last_token=True)


def _token_log_probs_case(key: dict, device: torch.device) -> TuneCase:
    return _LogitsCase(key, device, rows=key["num_tokens"], last_token=False)


def _last_token_presets() -> list[dict]:
    return [last_token_logits_tune_key(vocab_size=LLAMA_3_8B["vocab_size"],
                                       dtype=getattr(torch, LLAMA_3_8B["dtype"]), num_requests=r,
                                       log_softmax=ls)
            for r in (1, 16, 64, 256) for ls in (False, True)]


def _token_log_probs_presets() -> list[dict]:
    vocab, dtype = LLAMA_3_8B["vocab_size"], getattr(torch, LLAMA_3_8B["dtype"])
    keys = [token_log_probs_tune_key(vocab_size=vocab, dtype=dtype, num_tokens=n)
            for n in (1, 16, 64, 256)]
    return keys + [token_log_probs_tune_key(vocab_size=vocab, dtype=dtype, num_tokens=256,
                                            return_full=True)]


autotune.register(KernelTuning(
    name="last_token_logits", configs=last_token_logits_configs,
    default_config=last_token_logits_default_config, tune_key=last_token_logits_tune_key,
    token_field="num_requests", make_case=_last_token_case, presets=_last_token_presets))


autotune.register(KernelTuning(
    name="token_log_probs", configs=token_log_probs_configs,
    default_config=token_log_probs_default_config, tune_key=token_log_probs_tune_key,
    token_field="num_tokens", make_case=_token_log_probs_case, presets=_token_log_probs_presets))


@custom_op("dynctx::last_token_logits", mutates_args=())
def _last_token_logits_op(logits: torch.Tensor, cu_query_lengths: torch.Tensor, num_requests: int,
                          log_softmax: bool) -> torch.Tensor:
    return last_token_logits(logits, cu_query_lengths, num_requests, log_softmax=log_softmax)


@_last_token_logits_op.register_fake
def _(logits, cu_query_lengths, num_requests, log_softmax):
    vocab_size = logits.shape[-1]
    return logits.new_empty((num_requests, vocab_size),
                            dtype=torch.float32 if log_softmax else logits.dtype)


@custom_op("dynctx::token_log_probs", mutates_args=())
def _token_log_probs_op(logits: torch.Tensor, token_ids: torch.Tensor, return_full: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``token_log_probs``; without ``return_full`` the second output is an empty ``[0, V]``."""
    log_probs, full = token_log_probs(logits, token_ids, return_full=return_full)
    if full is None:
        full = logits.new_empty((0, logits.shape[-1]), dtype=torch.float32)
    return log_probs, full


@_token_log_probs_op.register_fake
def _(logits, token_ids, return_full):
    num_tokens, vocab_size = logits.shape[-2], logits.shape[-1]
    return (logits.new_empty((num_tokens,), dtype=torch.float32),
            logits.new_empty((num_tokens if return_full else 0, vocab_size), dtype=torch.float32))
