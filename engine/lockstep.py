"""Tensor-parallel lockstep: every rank runs the engine's methods on rank 0's arguments
(docs/SEMANTICS.md §18).

Every rank calls the same engine methods in the same order (as under ``torchrun``); the requests
are rank 0's, and since every rank then runs the same deterministic scheduling, bookkeeping and
sampling on the same logits (the model all-reduces), every rank returns the same outputs.
"""

from __future__ import annotations

import pickle
from typing import Any


def from_first_rank(tp: Any, *values: Any) -> tuple:
    """``values`` as the tensor-parallel group's first rank passed them (one
    ``broadcast_object_list``); unchanged without tensor parallelism (``tp`` None or of size
    1)."""
    if tp is None or tp.size == 1:
        return values
    import torch.distributed as dist

    # The first rank pickles first: an argument that cannot be sent (a generator, a lambda)
    # is reported to every rank, which all raise the same error, instead of leaving the
    # other ranks waiting in the broadcast.
    payload: Any = None
    first = dist.get_rank(tp.group) == 0
    if first:
        try:
            payload = ("ok", pickle.dumps(values))
        except Exception as error:  # noqa: BLE001 - raised on every rank below
            payload = ("error", f"{type(error).__name__}: {error}")
    box = [payload]
    dist.broadcast_object_list(box, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    kind, data = box[0]
    if kind == "error":
        raise TypeError("the arguments of tensor-parallel rank 0 cannot be sent to the other "
                        f"ranks ({data}); pass lists, tensors and dataclasses (what pickle "
                        "can copy)")
    return values if first else pickle.loads(data)
