"""What the ported Megatron-Core tests need to run on a CPU, against either implementation.

``test_dynamic_context.py`` in this folder is Megatron-Core's own unit test file (tag
``core_v0.16.1``); its test bodies name ``DynamicInferenceContext``, ``DynamicInferenceRequest``,
``SamplingParams``, ... as module globals. The ``impl`` fixture (``conftest.py``) binds those
names, for one test, to megatron-core 0.16.1's classes (``"megatron"``) or to dynctx's
(``"dynctx"``), so the same body checks both.

* ``Impl`` / ``load_impl(name)``: the names a test binds, and ``running()``, the context a test
  of that implementation runs in: for megatron-core, ``megatron_on_cpu()`` (see
  ``tests/megatron_oracle.py``) held for the whole test, since Megatron's test bodies and its
  block allocator call ``torch.cuda.current_device()`` outside the context's methods too; for
  both, the class-level rounders that the tests' ``set_rounder`` changes are restored after the
  test (Megatron's file leaks them from test to test).
* ``Utils``: the two calls of Megatron's ``tests.unit_tests.test_utilities.Utils`` the file
  uses, on a CPU. One process: only ``parallel_state``'s world sizes are set (what
  ``Utils.fake_initialize_model_parallel`` does), because nothing here communicates. Inside
  ``run_ranks``: the real ``parallel_state.initialize_model_parallel`` over the gloo group.
* ``run_ranks(fn, world_size, args, timeout_s)``: runs ``fn(*args)`` on ``world_size`` forked
  CPU processes joined in one gloo process group (a file store in a temporary folder) and
  raises with every failing rank's traceback (or the ranks still running at the timeout).
  Forked, not spawned: a spawned rank imports torch and megatron-core again, which costs tens
  of seconds on a loaded 2-core CI machine; each rank sets one intra-op thread first, so the
  parent's thread pool is never used in the child.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Sequence

import torch

IMPLS = ("megatron", "dynctx")

#: Where the ported tests put their tensors (Megatron's file says ``'cuda'``).
DEVICE = "cpu"

#: Class attributes that ``set_rounder`` in the test file writes.
ROUNDER_ATTRS = ("ROUNDER", "TOKEN_ROUNDER", "REQUEST_ROUNDER")

_MISSING = object()


@dataclass(frozen=True)
class Impl:
    """One implementation under test: the module-level names its tests bind."""

    name: str
    DynamicInferenceContext: Any
    RequestOverflowError: type
    TokenOverflowError: type
    DynamicInferenceRequest: type
    SamplingParams: type
    MambaInferenceStateConfig: type
    context_class: type

    def names(self) -> Dict[str, Any]:
        """The test module's globals to bind for this implementation."""
        return {
            "DynamicInferenceContext": self.DynamicInferenceContext,
            "RequestOverflowError": self.RequestOverflowError,
            "TokenOverflowError": self.TokenOverflowError,
            "DynamicInferenceRequest": self.DynamicInferenceRequest,
            "SamplingParams": self.SamplingParams,
            "MambaInferenceStateConfig": self.MambaInferenceStateConfig,
        }

    @contextlib.contextmanager
    def running(self) -> Iterator["Impl"]:
        """Hold what a test of this implementation needs; restore the class rounders after."""
        saved = {attr: self.context_class.__dict__.get(attr, _MISSING) for attr in ROUNDER_ATTRS}
        try:
            if self.name == "megatron":
                from megatron_oracle import megatron_on_cpu

                with megatron_on_cpu():
                    yield self
            else:
                yield self
        finally:
            for attr, value in saved.items():
                if value is _MISSING:
                    if attr in self.context_class.__dict__:
                        delattr(self.context_class, attr)
                else:
                    setattr(self.context_class, attr, value)


def load_impl(name: str) -> Impl:
    """``"megatron"``: megatron-core 0.16.1; ``"dynctx"``: this repository's context."""
    if name == "megatron":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # missing TE / Apex warnings
            from megatron.core.inference.contexts import dynamic_context as mdc
            from megatron.core.inference.contexts.attention_context.mamba_metadata import (
                MambaInferenceStateConfig,
            )
            from megatron.core.inference.inference_request import DynamicInferenceRequest
            from megatron.core.inference.sampling_params import SamplingParams
        return Impl(
            name=name,
            DynamicInferenceContext=mdc.DynamicInferenceContext,
            RequestOverflowError=mdc.RequestOverflowError,
            TokenOverflowError=mdc.TokenOverflowError,
            DynamicInferenceRequest=DynamicInferenceRequest,
            SamplingParams=SamplingParams,
            MambaInferenceStateConfig=MambaInferenceStateConfig,
            context_class=mdc.DynamicInferenceContext,
        )
    if name == "dynctx":
        import dynctx.context as dc

        return Impl(
            name=name,
            DynamicInferenceContext=dc.DynamicInferenceContext,
            RequestOverflowError=dc.RequestOverflowError,
            TokenOverflowError=dc.TokenOverflowError,
            DynamicInferenceRequest=dc.DynamicInferenceRequest,
            SamplingParams=dc.SamplingParams,
            MambaInferenceStateConfig=dc.MambaInferenceStateConfig,
            context_class=dc.DynamicInferenceContext,
        )
    raise ValueError(f"impl={name!r} must be one of {IMPLS}")


class Utils:
    """``tests.unit_tests.test_utilities.Utils`` of Megatron-LM, reduced to what the file uses."""

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
            return
        world = tensor_model_parallel_size * pipeline_model_parallel_size
        if world != 1:
            raise RuntimeError(
                f"tensor_model_parallel_size={tensor_model_parallel_size} x "
                f"pipeline_model_parallel_size={pipeline_model_parallel_size} needs "
                f"{world} processes: run the test body through run_ranks")
        ps.set_tensor_model_parallel_world_size(1)
        ps.set_tensor_model_parallel_rank(0)
        ps.set_pipeline_model_parallel_world_size(1)
        ps.set_pipeline_model_parallel_rank(0)
        ps.set_expert_model_parallel_world_size(1)
        ps.set_expert_model_parallel_rank(0)

    @staticmethod
    def destroy_model_parallel():
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


def _rank_main(fn: Callable, rank: int, world_size: int, init_method: str, errors,
               args: Sequence[Any]) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size)
    failed = False
    try:
        fn(*args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        failed = True
    finally:
        torch.distributed.destroy_process_group()
    if failed:
        raise SystemExit(1)  # the traceback goes to the parent, not to stderr


def run_ranks(fn: Callable, *, world_size: int, args: Sequence[Any] = (),
              timeout_s: float = 60.0) -> None:
    """Run ``fn(*args)`` on ``world_size`` forked CPU ranks over gloo; raise if any fails.

    A rank still running after ``timeout_s`` seconds is killed and reported.
    """
    ctx = multiprocessing.get_context("fork")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="dynctx-ranks-") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main,
                             args=(fn, rank, world_size, init_method, errors, tuple(args)),
                             name=f"rank{rank}")
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [proc.name for proc in procs if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        reports = []
        while not errors.empty():
            rank, text = errors.get()
            reports.append(f"--- rank {rank} ---\n{text}")
        codes = {proc.name: proc.exitcode for proc in procs}
    if hung:
        raise TimeoutError(f"ranks {hung} still running after timeout_s={timeout_s}; "
                           f"exit codes {codes}\n" + "\n".join(reports))
    if reports or any(code != 0 for code in codes.values()):
        raise RuntimeError(f"rank exit codes {codes}\n" + "\n".join(reports))
