"""Property test: a hypothesis state machine drives the context through random sequences of
add / step / finish / pause / evict / chunk / suspend / resume / reset and checks every invariant
after every rule, for plain, MLA and hybrid (Mamba + attention) contexts (the driver:
``state_machine.py``, which admits through the engine's ``Scheduler``; its invariants:
``machine_checks.py``; the long run without shrinking: ``soak.py``)."""

from __future__ import annotations

import pytest
import torch
from helpers import add, assert_same, make_ctx, request, snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from state_machine import CI_CONFIGS, CONFIGS, ContextDriver, MachineConfig

# Deterministic and sized for CI (the eleven configurations, four of them hybrids and three
# speculative, together take about a minute of CPU on one core): no example database,
# derandomized generation, no deadline.
# The long run is soak.py (in this folder).
SETTINGS = settings(max_examples=50, stateful_step_count=50, deadline=None, derandomize=True,
                    database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])

# Indices of active requests that finish in a step (indices past the active count do nothing).
_FINISH = st.sets(st.integers(0, 15), max_size=2)


class ContextMachine(RuleBasedStateMachine):
    """The rules call the driver's actions; the driver raises ``Violation`` on a broken
    invariant (and checks its own expectations inside each action)."""

    CONFIG: MachineConfig = None

    def __init__(self):
        super().__init__()
        self.driver = ContextDriver(self.CONFIG)

    steps_since_lifecycle = 0

    @rule(prompt_len=st.integers(1, 39), gen=st.integers(1, 64), device=st.booleans())
    def add_request(self, prompt_len, gen, device):
        self.driver.add_new("fit", prompt_len, gen)
        self.driver.check(device=device)

    @rule(kind=st.sampled_from(["too_long", "too_many_tokens", "duplicate"]),
          prompt_len=st.integers(1, 20), gen=st.integers(1, 39), pick=st.integers(0, 7))
    def add_bad_request(self, kind, prompt_len, gen, pick):
        """Rejected with MaxSequenceLengthOverflowError, TokenOverflowError or ValueError
        (duplicate id); the driver checks that the state is unchanged."""
        self.driver.add_new(kind, prompt_len, gen, pick)

    @precondition(lambda self: self.driver.ctx.paused_request_count > 0)
    @rule(prompt_len=st.integers(1, 12), gen=st.integers(1, 64), device=st.booleans())
    def add_request_while_paused(self, prompt_len, gen, device):
        self.driver.add_new("fit", prompt_len, gen)
        self.driver.check(device=device)

    @rule(prompt_len=st.integers(2, 39), gen=st.integers(1, 64), first=st.integers(0, 63))
    def start_chunked_prefill(self, prompt_len, gen, first):
        self.driver.add_new("chunked", prompt_len, gen, first)

    @precondition(lambda self: self.driver.waiting)
    @rule()
    def admit_waiting(self):
        self.driver.admit()

    @precondition(lambda self: self.driver.live)
    @rule(finishes=st.lists(_FINISH, min_size=1, max_size=6), mask_as_int=st.booleans(),
          choice=st.integers(0, 63), layout=st.integers(0, 2), logprobs=st.booleans(),
          reinit=st.booleans(), device=st.booleans())
    def steps(self, finishes, mask_as_int, choice, layout, logprobs, reinit, device):
        """Up to six steps, each finishing the active requests at the given indices."""
        for i, finish in enumerate(finishes):
            if not self.driver.live:
                break
            self.driver.step(finish, mask_as_int=mask_as_int, choice=choice + i, layout=layout,
                             logprobs=logprobs and i == 0, reinit=reinit and i == 0)
            self.driver.check(device=device or i == len(finishes) - 1)
            self.steps_since_lifecycle += 1

    @precondition(lambda self: self.steps_since_lifecycle >= 4)
    @rule(kind=st.sampled_from(["suspend", "suspend_and_probe", "reset"]))
    def lifecycle(self, kind):
        """Suspend + resume (the in-flight requests are re-added and run on), or reset."""
        self.steps_since_lifecycle = 0
        if kind == "reset":
            self.driver.reset()
        else:
            self.driver.suspend_resume(check_calls=kind == "suspend_and_probe")

    @invariant()
    def invariants(self):
        self.driver.check(device=False)


@pytest.fixture
def one_thread():
    """Tiny tensors: torch's intra-op threads only add overhead (and noise under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("config", CI_CONFIGS, ids=lambda c: c.name)
def test_context_state_machine(config, one_thread):
    machine = type(f"ContextMachine_{config.name.replace('-', '_')}", (ContextMachine,),
                   {"CONFIG": config})
    run_state_machine_as_test(machine, settings=SETTINGS)


# The scripted run also covers KV offload with speculative steps (a paused row's KV may end
# mid-block after a rewind; a restore brings back exactly its accepted tokens).
SCRIPTED = CI_CONFIGS + [c for c in CONFIGS.values() if c.speculative and c.kv_offload_blocks]


@pytest.mark.parametrize("config", SCRIPTED, ids=lambda c: c.name)
def test_driver_reaches_pause_evict_chunk_and_suspend(config, one_thread):
    """The machine's workload really exercises the hard paths (a fixed scripted run): requests
    pause and resume or are evicted, chunked prefills continue, a suspend re-adds and runs on."""
    driver = ContextDriver(config)
    for i in range(8):
        driver.add_new("fit", 10 + i, 30 - i)
        driver.check()
    driver.add_new("chunked", 30, 5, 7)
    for i in range(60):
        if not driver.live:
            break
        driver.step(choice=i)
        driver.check()
        driver.admit()
        driver.check()
        if i == 20:
            driver.suspend_resume()
            driver.check()
            assert driver.ctx.total_request_count > 0, "re-added requests must run on"
    stats = driver.stats
    # One scripted suspend, beside those that recover from a stalled continuation.
    assert stats["steps"] >= 20 and stats["chunks"] >= 2
    assert stats["suspends"] == 1 + stats["stalls"], dict(stats)
    assert (stats["pauses"] + stats["evictions"] > 0) == config.pauses, dict(stats)
    if config.prefix_caching is not None:
        assert stats["prefix_hits"] > 0, dict(stats)
    if config.kv_offload_blocks:
        assert stats["offloads"] > 0 and stats["restores"] > 0, dict(stats)


HOST_TIER_CONFIGS = [c for c in CONFIGS.values() if c.host_tier]


@pytest.mark.parametrize("config", HOST_TIER_CONFIGS, ids=lambda c: c.name)
def test_driver_spills_prefix_blocks_to_the_host_and_restores_them(config, one_thread):
    """The prefix cache's host tier under the machine's checks (a fixed scripted run): long
    prompts of the two families alternate, so each family's cached blocks are pushed out of
    the device by the other's (spilled to the host, some dropped for room) and hit there by
    the next request of the family (restored); a hybrid's snapshots go the same way."""
    driver = ContextDriver(config)
    for length in (37, 37, 37, 37, 30, 37):
        driver.add_new("fit", length, 2)
        driver.check()
        for i in range(40):
            if not driver.live and not driver.waiting:
                break
            if driver.live:
                driver.step(choice=i)
                driver.check()
            driver.admit()
            driver.check()
    assert not driver.live and not driver.waiting
    tier = driver.ctx.get_kv_offload_stats()
    assert driver.stats["prefix_hits"] >= 2, dict(driver.stats)
    assert tier["kv_offload_prefix_spilled_blocks"] > 0, tier
    assert tier["kv_offload_prefix_restored_blocks"] > 0, tier
    if config.hybrid:
        assert tier["kv_offload_prefix_restored_snapshots"] > 0, tier


def test_step_without_the_chunked_continuation_is_refused():
    ctx = make_ctx(max_tokens=16)
    req = request(7, 20, gen=4)
    add(ctx, req, chunk_length=8)  # ends on a block boundary (block size 4)
    ctx.chunked_prefill_request_id = 7
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([True]), torch.tensor([55]))
    # The engine could not schedule the next chunk (e.g. no free block) and steps anyway.
    with pytest.raises(RuntimeError, match="chunked"):
        ctx.initialize_attention_state()


def test_hybrid_add_after_the_final_chunk_keeps_the_continuation_state():
    cfg = MachineConfig("repro", block_size=4, buffer_blocks=16, paused_blocks=4,
                        max_tokens=16, layer_types=("M", "*"))
    ctx = cfg.make_context()
    long = request(5, 20, gen=4)
    add(ctx, long, chunk_length=12)
    ctx.chunked_prefill_request_id = 5
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([True]), torch.tensor([51]))
    ctx.chunked_prefill_request_id = -1
    add(ctx, long, chunk_length=8)  # the final chunk: must start from the saved Mamba state
    before = snapshot(ctx)
    # An add after it would take the continuation's place as the last row: refused.
    with pytest.raises(ValueError, match="hybrid"):
        ctx.add_request(request(6, 3))
    assert_same(before, snapshot(ctx))
    ctx.initialize_attention_state()
    meta = ctx.mamba_metadata
    assert meta.batch_indices_chunked_prefill.tolist() == [int(ctx._h_req[7, 0])]
    assert meta.device_chunked_prefill == (0, 8)
