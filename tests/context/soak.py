"""Soak: the context state machine of ``tests/context/state_machine.py`` for many steps.

The same model engine (admitting through the engine's ``Scheduler``) and invariant checks
(``tests/context/machine_checks.py``) as the hypothesis test, driven by a seeded
``random.Random`` instead of hypothesis (no shrinking), over several seeds and configurations
(block sizes 4 and 8, an explicit paused budget, the default half split at
``unified_memory_level=0``, no paused budget at all, the MLA latent cache, and hybrid Mamba +
attention models, whose Mamba slots and per-request state patterns are checked too). An invariant
violation (or any unexpected exception) is counted, its first message is printed, and the run
continues with a fresh context.

    python -P tests/context/soak.py --steps 10000  # prints a table; exit code 1 on a violation
    python -P tests/context/soak.py --steps 2000 --seeds 0 1 --configs bs4-paused4 mla-bs8-paused3
    python -P tests/context/soak.py --steps 4000 --configs hyb-bs4-paused4 hyb-bs8-half

``--steps`` is the total number of forward steps (``initialize_attention_state`` +
``update_requests``), split evenly over the (configuration, seed) runs. It is a test driver, not
a benchmark, so it lives beside the state machine it drives (and puts this folder and
``tests/``, not the checkout, on ``sys.path``; run it from any folder).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):  # tests/ (sizing_warning), then tests/context/ first
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from state_machine import CONFIGS, ContextDriver  # noqa: E402

# Relative weights of the engine's actions per iteration (a step is the common case).
ACTIONS = {"step": 60, "admit": 12, "add": 16, "add_bad": 3, "chunked": 5, "suspend": 0.6,
           "reset": 0.2}
ADD_KINDS = {"too_long": 1, "too_many_tokens": 1, "duplicate": 1}
COLUMNS = ("steps", "finished", "pauses", "resumes", "evictions", "chunks", "suspends", "resets",
           "stalls", "adds", "rejected_adds", "adds_while_paused", "deferred_adds",
           "prefix_hits")


def one_action(driver: ContextDriver, rng: random.Random) -> None:
    """One engine action with random arguments, then the invariants."""
    cfg = driver.cfg
    S = cfg.max_sequence_length
    action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
    if action == "step" and not driver.live:
        action = "add"
    if action == "step":
        # Finishing early is rare: most requests run to their length limit.
        finish = {i for i in range(cfg.max_requests) if rng.random() < 0.03}
        driver.step(finish, mask_as_int=rng.random() < 0.5, choice=rng.randrange(64),
                    layout=rng.randrange(3), logprobs=rng.random() < 0.2,
                    reinit=rng.random() < 0.05)
    elif action == "admit":
        driver.admit()
    elif action == "add":
        prompt = rng.randint(1, 24) if rng.random() < 0.9 else rng.randint(25, S - 1)
        gen = S if rng.random() < 0.5 else rng.randint(1, S)
        driver.add_new("fit", prompt, gen, rng.randrange(64))
    elif action == "add_bad":
        kind = rng.choices(list(ADD_KINDS), weights=list(ADD_KINDS.values()))[0]
        driver.add_new(kind, rng.randint(1, 20), rng.randint(1, S), rng.randrange(64))
    elif action == "chunked":
        driver.add_new("chunked", rng.randint(2, S - 1), rng.randint(1, S), rng.randrange(64))
    elif action == "suspend":
        driver.suspend_resume(check_calls=rng.random() < 0.3)
    else:
        driver.reset()
    driver.check(device=rng.random() < 0.5)


def soak(config_name: str, seed: int, steps: int) -> dict:
    """Run one configuration until ``steps`` forward steps; returns the totals."""
    cfg = CONFIGS[config_name]
    rng = random.Random(f"{config_name}/{seed}")
    totals: Counter = Counter()
    violations, first = 0, None
    driver = ContextDriver(cfg)
    actions = 0
    start = time.perf_counter()
    # A violation restarts the context; the action cap ends a run whose violations come before
    # any step completes.
    while totals["steps"] + driver.stats["steps"] < steps and actions < 20 * steps:
        actions += 1
        try:
            one_action(driver, rng)
        except Exception as error:  # noqa: BLE001 - a violation or any unexpected error
            violations += 1
            if first is None:
                first = (f"{config_name} seed {seed}, action {actions}: {type(error).__name__}: "
                         f"{error}\n  last actions: {driver.actions[-8:]}\n"
                         + "".join(traceback.format_exc().splitlines(True)[-6:]))
            totals.update(driver.stats)
            driver = ContextDriver(cfg)  # continue with a fresh context
    totals.update(driver.stats)
    return dict(config=config_name, seed=seed, actions=actions, violations=violations,
                first=first, seconds=time.perf_counter() - start,
                **{name: totals[name] for name in COLUMNS})


def print_table(rows: list[dict]) -> None:
    head = ("config", "seed") + COLUMNS + ("actions", "violations", "seconds")
    short = {"rejected_adds": "rejected", "adds_while_paused": "add@paused",
             "deferred_adds": "deferred"}
    names = [short.get(h, h) for h in head]
    cells = [[str(r[h]) if h != "seconds" else f"{r[h]:.1f}" for h in head] for r in rows]
    widths = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    line = lambda values: "  ".join(v.rjust(w) for v, w in zip(values, widths))  # noqa: E731
    print(line(names))
    for c in cells:
        print(line(c))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10000,
                        help="total forward steps over all runs (default 10000)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    runs = [(c, s) for c in args.configs for s in args.seeds]
    per_run = -(-args.steps // len(runs))
    start = time.perf_counter()
    rows = []
    for config_name, seed in runs:
        row = soak(config_name, seed, per_run)
        if row["first"]:
            print(f"VIOLATION ({row['violations']} in this run), first:\n{row['first']}",
                  flush=True)
        rows.append(row)
    total = {"config": "TOTAL", "seed": "-"}
    for key in COLUMNS + ("actions", "violations", "seconds"):
        total[key] = sum(r[key] for r in rows)
    rows.append(total)
    print_table(rows)
    print(f"{total['steps']} steps, {total['violations']} violations, "
          f"{time.perf_counter() - start:.1f} s wall")
    return 1 if total["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
