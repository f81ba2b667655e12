"""pytest-benchmark microbenchmarks of every registered kernel against its torch reference.

``pytest bench --benchmark-only`` (``make bench``). Each kernel key is one benchmark group with
up to four members: ``triton`` (the kernel with its resolved config), ``torch`` (the reference),
``copy`` (a device-to-device copy of the same number of bytes) and, for ``kv_append``,
``megatron_core`` (Megatron-Core 0.16.1's own kernel, loaded by ``dynctx.megatron_peer``).

On a CUDA device the keys are the kernels' ``presets()`` and every call is followed by a
synchronize. On a CPU only the torch references and the copy run, at scaled-down keys (the
token field at most 4, or the kernel module's ``scaled_down_key``); the Triton kernels are
timed on CUDA only. ``extra_info`` carries the key, the config, the bytes moved and GB/s from
the median time. These are host wall-clock timings of single launches; the CUDA-graph timings
of ``python -m dynctx autotune bench`` are the ones that go into bench/results/.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dynctx import megatron_peer
from dynctx.kernels import autotune, registry
from dynctx.kernels.backend import triton_interpreting

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda" and not triton_interpreting()

registry.import_kernel_modules(quiet=True)


def _scaled_down(tuning, key: dict) -> dict:
    hook = getattr(sys.modules[tuning.configs.__module__], "scaled_down_key", None)
    return hook(key) if hook else {**key, tuning.token_field: min(key[tuning.token_field], 4)}


def _key_id(key: dict) -> str:
    """``dtypebfloat16_head_dim128_num_tokens4``: a test id that ``pytest -k`` can match."""
    return "_".join(f"{k}{v}" for k, v in sorted(key.items()))


def _cases() -> list:
    params, seen = [], set()
    for tuning in registry.select_tunings(None, "all"):
        if tuning.presets is None or tuning.make_case is None:
            continue
        for key in tuning.presets():
            key = key if ON_GPU else _scaled_down(tuning, key)
            ident = (tuning.name, json.dumps(key, sort_keys=True))
            if ident in seen:
                continue
            seen.add(ident)
            impls = ["torch", "copy"]
            if ON_GPU:
                impls = (["triton"] + impls
                         + (["megatron_core"] if tuning.name == "kv_append" else []))
            for impl in impls:
                params.append(pytest.param(tuning.name, key, impl,
                                           id=f"{tuning.name}-{_key_id(key)}-{impl}"))
    if not params:
        return [pytest.param(None, None, None, id="no-kernels-registered")]
    if not ON_GPU:
        params.append(pytest.param(None, None, "triton", id="triton-kernels"))
    return params


def _synchronized(fn):
    if DEVICE.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()
    return run


@pytest.mark.parametrize("name, key, impl", _cases())
def test_kernel(benchmark, name, key, impl):
    if name is None and impl is None:
        pytest.skip("no kernel module is registered yet")
    if name is None:
        pytest.skip("the Triton kernels and Megatron-Core's are timed on CUDA only (this run: "
                    f"{DEVICE.type}{', TRITON_INTERPRET set' if triton_interpreting() else ''}); "
                    "the torch references ran at scaled-down keys")
    tuning = autotune.get_tuning(name)
    case = tuning.make_case(key, DEVICE)
    config, source = autotune.resolve_config(name, key, DEVICE)
    if impl == "triton":
        case.check(config)
        fn = lambda: case.run(config)  # noqa: E731
    elif impl == "torch":
        fn = case.run_reference
    elif impl == "copy":
        source_buffer = torch.randint(0, 255, (max(1, case.bytes_moved // 2),), dtype=torch.uint8,
                                      device=DEVICE)
        target_buffer = torch.empty_like(source_buffer)
        fn = lambda: target_buffer.copy_(source_buffer)  # noqa: E731
    else:
        fn, why = megatron_peer.runner_from_case(case)
        if fn is None:
            pytest.skip(f"Megatron-Core's kv append is not available: {why}")
        megatron_peer.check_against_ours(case, config)
    fn()  # warm up (compilation) before pytest-benchmark's own calibration
    benchmark.group = f"{name} {registry.key_text(key)}"
    benchmark.extra_info.update(kernel=name, key=key, impl=impl, device=str(DEVICE),
                                bytes_moved=int(case.bytes_moved),
                                config=str(config) if impl == "triton" else None,
                                config_source=source.split(":", 1)[0] if impl == "triton" else None)
    benchmark(_synchronized(fn))
    stats = getattr(benchmark, "stats", None)
    if stats is not None and case.bytes_moved:
        benchmark.extra_info["gbps"] = round(case.bytes_moved / stats.stats.median / 1e9, 3)
