"""Building kernel configs for sm_90 with the stub driver, in worker processes.

Used by ``test_sm90_build.py``: each job builds one tuning's search space at its presets (or
one committed file's configs at their keys) and returns what it found, so that the jobs can
run in a process pool, one per core, and the tests assert on the reports.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

# The counts of a key, made small: builds do not depend on them (the launchers mark counts
# do_not_specialize; test_recompiles.py checks that). Model dimensions and dtypes stay.
BUILD_COUNTS = {"num_tokens": 4, "num_requests": 2, "num_rows": 4, "max_seqlen_k": 600}


def build_key(key: dict) -> dict:
    return {name: min(value, BUILD_COUNTS[name]) if name in BUILD_COUNTS else value
            for name, value in key.items()}


def _problems(stub, made_by: dict | None = None) -> tuple[list[str], list[dict]]:
    """Every build and launch the stub recorded that is over sm_90's limits, and each build's
    resource usage; ``made_by`` names the (key, config) whose launch made each build."""
    from dynctx.kernels.stub_driver import (
        GRID_LIMITS,
        MAX_THREADS_PER_BLOCK,
        SM90_SHARED_LIMIT,
        resource_usage,
    )

    problems, usages = [], []
    for index, build in enumerate(stub.record.builds):
        usage = resource_usage(build)
        name = f"{build.kernel} w{build.num_warps} s{build.num_stages}"
        if made_by and index in made_by:
            name += f" ({made_by[index]})"
        usages.append({"kernel": name, **usage, "shared_bytes": build.shared})
        if usage["spill_stores"] or usage["spill_loads"]:
            problems.append(f"{name}: spills ({usage})")
        if build.shared > SM90_SHARED_LIMIT:
            problems.append(f"{name}: {build.shared} B of shared memory > {SM90_SHARED_LIMIT}")
        if build.num_warps * 32 > MAX_THREADS_PER_BLOCK:
            problems.append(f"{name}: {build.num_warps * 32} threads > {MAX_THREADS_PER_BLOCK}")
    for launch in stub.record.launches:
        if any(g > limit for g, limit in zip(launch.grid, GRID_LIMITS)):
            problems.append(f"{launch.build.kernel}: grid {launch.grid} over {GRID_LIMITS}")
    return problems, usages


def build_job(job: tuple[str, str]) -> dict:
    """``("tuning", name)``: the whole search space at every preset; ``("file", path)``: each
    committed config at its own key. Returns the counts and the problems found."""
    import torch

    from dynctx.kernels import autotune, registry
    from dynctx.kernels.autotune import KernelConfig
    from dynctx.kernels.stub_driver import stub_driver

    registry.import_kernel_modules(quiet=True)
    kind, what = job
    cases = []  # (tuning, key, configs)
    if kind == "tuning":
        tuning = autotune.get_tuning(what)
        for key in tuning.presets():
            space = tuning.configs(key)
            if space != tuning.configs(build_key(key)):
                return {"job": job, "configs": 0, "builds": 0, "usages": [],
                        "problems": [f"the search space at {key} depends on its counts"]}
            cases.append((tuning, key, space))
    else:
        data = json.loads(open(what, encoding="utf-8").read())
        tuning = autotune.get_tuning(data["kernel"])
        cases = [(tuning, e["key"], [KernelConfig.from_dict(e["config"])])
                 for e in data["entries"]]
    configs, made_by = 0, {}
    with stub_driver() as stub:
        for tuning, key, space in cases:
            case = tuning.make_case(build_key(key), torch.device("cpu"))
            for config in space:
                before = len(stub.record.builds)
                case.run(config)
                configs += 1
                for index in range(before, len(stub.record.builds)):
                    made_by[index] = f"{config} at {registry.key_text(key)}"
    problems, usages = _problems(stub, made_by)
    return {"job": job, "configs": configs, "builds": len(stub.record.builds),
            "launches": len(stub.record.launches), "usages": usages, "problems": problems}


def run_jobs(jobs: list[tuple[str, str]]) -> dict[tuple[str, str], dict]:
    """Every job's report, the jobs spread over one worker process per core (at most 4)."""
    workers = max(1, min(4, os.cpu_count() or 1, len(jobs)))
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        return {report["job"]: report for report in pool.map(build_job, jobs)}


def mma_instructions(build) -> set:
    """The tensor-core instructions (``HMMA``/``HGMMA`` with their shape and types, e.g.
    ``HMMA.1688.F32.TF32``) in a build's SASS (``cuobjdump -sass`` of its cubin)."""
    import re

    from dynctx.kernels.stub_driver import cuobjdump

    return set(re.findall(r"\bH(?:G)?MMA(?:\.\w+)+", cuobjdump(build, "-sass")))
