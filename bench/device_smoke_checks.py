"""The checks of bench/device_smoke.py (its docstring says what each does): each takes the
``Env`` and returns ``(summary line, details)``, or raises (``CheckFailed`` with its details, or
any error); ``CHECK_FUNCTIONS`` maps their names to them. Public APIs only: the engine, the
context, ``dynctx.kernels.paged_attention``, and ``bench/step_overhead.py``'s sync counter.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from itertools import accumulate
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dynctx.context import DynamicInferenceContext, DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine
from dynctx.kernels import paged_attention

BENCH = Path(__file__).resolve().parent


class CheckFailed(Exception):
    """A check's own verdict (not a crash): ``details`` go to its line."""

    def __init__(self, message: str, details: Optional[dict] = None):
        super().__init__(message)
        self.details = details or {}


class CheckSkipped(Exception):
    """The check cannot run here (the reason is its summary)."""


class Env:
    """The device the checks run on. ``device_arg`` is ``--device`` exactly as given (``"cuda"``,
    unindexed: what a user writes); ``device`` its ``torch.device``."""

    def __init__(self, device_arg: str):
        self.device_arg = device_arg
        self.device = torch.device(device_arg)
        self.cuda = self.device.type == "cuda"
        self.gpu = torch.cuda.get_device_name(self.device) if self.cuda else None
        self.interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        # The compiled kernels on CUDA; on a CPU the interpreter when it is on, else the
        # torch reference.
        self.kernel_backend = "triton" if self.cuda or self.interpreting else "torch"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def busy(self, ms: float) -> None:
        """Queue about ``ms`` milliseconds of device work on the current stream (CUDA only)."""
        if not self.cuda:
            return
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(int(ms * 2e6))  # cycles, at about 2 GHz
            return
        a = torch.randn(2048, 2048, device=self.device)
        for _ in range(max(1, int(ms))):
            a = a @ a
            a /= a.norm()


#: The tiny Llama of the engine checks (fp32: its greedy tokens are transformers' exactly).
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPT_LENGTHS = (3, 17, 40, 9, 26, 1)
ARRIVALS = (0, 0, 1, 2, 4, 4)
NEW_TOKENS = 10
BLOCK_SIZE = 16
GRAPHS = 4


def tiny_llama(env: Env, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval().to(device=env.device, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(seed: int = 1) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, LLAMA["vocab_size"], (n,), generator=gen).tolist()
            for n in PROMPT_LENGTHS]


def hf_greedy(hf, prompt: List[int], new_tokens: int) -> List[int]:
    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def build_engine(hf, device, **kwargs):
    """``Engine.from_transformers`` with 48 blocks of 16 tokens (8 paused), 32 tokens a step
    (prompts over 32 tokens are chunked), 8 requests."""
    block_bytes = 4 * 2 * LLAMA["num_hidden_layers"] * BLOCK_SIZE * LLAMA["num_key_value_heads"] \
        * (LLAMA["hidden_size"] // LLAMA["num_attention_heads"])
    return Engine.from_transformers(
        hf, device=device, block_size_tokens=BLOCK_SIZE, buffer_size_gb=48 * block_bytes / 2 ** 30,
        paused_buffer_size_gb=8 * block_bytes / 2 ** 30, max_tokens=32, max_requests=8,
        unified_memory_level=0, **kwargs)


MODES = {"eager": {}, "graphs": dict(num_cuda_graphs=GRAPHS),
         "async": dict(async_scheduling=True),
         "graphs_async": dict(num_cuda_graphs=GRAPHS, async_scheduling=True)}


def runner_name(engine) -> Optional[str]:
    runner = getattr(engine, "graph_runner", None)
    return None if runner is None else type(runner).__name__


def check_engine_cuda(env: Env):
    hf = tiny_llama(env)
    engine = build_engine(hf, env.device_arg)
    ps = prompts()
    got = engine.generate(ps, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in ps]
    same = sum(a == b for a, b in zip(got, want))
    details = dict(device_given=env.device_arg, context_device=str(engine.context.device),
                   attention_backend=getattr(engine.model, "attention_backend", None),
                   prompts=len(ps), same_as_transformers=same)
    if same != len(ps):
        raise CheckFailed(f"{len(ps) - same} of {len(ps)} prompts differ from transformers' "
                          "greedy generate", details)
    return (f"built with device={env.device_arg!r} (context on {details['context_device']}, "
            f"attention {details['attention_backend']}); tokens = transformers'"), details


def check_engine_modes(env: Env):
    hf = tiny_llama(env)
    ps = prompts()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in ps]
    outputs, details = {}, {}
    for mode, kwargs in MODES.items():
        engine = build_engine(hf, env.device, **kwargs)
        outputs[mode] = engine.generate(ps, max_new_tokens=NEW_TOKENS,
                                        arrival_steps=list(ARRIVALS), ignore_eos=True)
        details[mode] = dict(runner=runner_name(engine), graph_replays=engine.graph_replays,
                             forward_steps=engine.stats.forward_steps,
                             chunked_prefills=engine.stats.chunked_prefills,
                             same_as_eager=sum(a == b for a, b in
                                               zip(outputs[mode], outputs.get("eager", []))))
        del engine
    problems = []
    if outputs["eager"] != want:
        problems.append("eager differs from transformers' greedy generate")
    problems += [f"{mode} differs from eager" for mode in MODES
                 if outputs[mode] != outputs["eager"]]
    problems += [f"{mode} replayed no graph" for mode in ("graphs", "graphs_async")
                 if details[mode]["graph_replays"] == 0]
    if problems:
        raise CheckFailed("; ".join(problems), details)
    replays = ", ".join(f"{m} {details[m]['graph_replays']}" for m in ("graphs", "graphs_async"))
    return (f"eager = graphs = async = graphs+async = transformers ({len(ps)} prompts); "
            f"replays: {replays}"), details


class SyncCount:
    """``with SyncCount(env, engine) as count: engine.step()``; then ``count.result``: the
    host-device syncs inside, by ``bench/step_overhead.py``'s counter (by kind and op) and, on
    CUDA, by CUDA's sync debug mode (its warnings) and the CUDA event waits."""

    def __init__(self, env: Env, engine):
        # Imported here: bench/ is not on sys.path under -P, and a problem with it fails this
        # check only.
        if str(BENCH) not in sys.path:
            sys.path.insert(0, str(BENCH))
        from step_overhead import OverheadCounter

        self.env = env
        self.counter = OverheadCounter(env.device, roots=[engine.context])
        self.result: dict = {}

    def __enter__(self) -> "SyncCount":
        self._counting = self.counter.counting()
        self._counting.__enter__()
        if self.env.cuda:
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            self._waits = [0]
            self._event_sync = original = torch.cuda.Event.synchronize

            def counted(event, waits=self._waits):
                waits[0] += 1
                return original(event)

            torch.cuda.Event.synchronize = counted
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        self._counting.__exit__(*exc)
        counts = dict(self.counter.syncs)
        self.result = dict(counter=sum(counts.values()), by_kind=counts,
                           by_op={f"{kind}:{op}": n
                                  for (kind, op), n in self.counter.sync_ops.items()})
        if self.env.cuda:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.Event.synchronize = self._event_sync
            self._warnings.__exit__(*exc)
            self.result["cuda_sync_warnings"] = sum("synchroniz" in str(w.message)
                                                    for w in self._caught)
            self.result["event_waits"] = self._waits[0]


def check_engine_syncs(env: Env):
    hf = tiny_llama(env)
    ps = prompts()
    details = {}
    for mode, kwargs in MODES.items():
        engine = build_engine(hf, env.device, **kwargs)
        for i, p in enumerate(ps):
            engine.add_request(DynamicInferenceRequest(
                request_id=i, prompt_tokens=torch.tensor(p, dtype=torch.int64),
                sampling_params=SamplingParams(temperature=1.0, top_k=1,
                                               num_tokens_to_generate=NEW_TOKENS,
                                               termination_id=None)))
        decode, other = [], []
        while engine.has_unfinished_requests():
            with SyncCount(env, engine) as count:
                result = engine.step()
            if not result.idle:
                pure = result.tokens == result.active_requests and result.active_requests
                (decode if pure else other).append(count.result)
        details[mode] = _sync_summary(decode, other)
        del engine
    goal = None
    if env.cuda:
        # Issue 19 §1: at most one device-to-host read per synchronous step, none that blocks
        # the host in async mode (the pinned read-back's event wait is the designed wait).
        goal = all(details[m]["decode_max"] <= (0 if "async" in m else 1) for m in MODES)
    details["goal_met"] = goal
    line = ", ".join(f"{m} {details[m]['decode_mean']:.1f}/{details[m]['decode_max']}"
                     for m in MODES)
    where = "" if env.cuda else " (CPU emulation: the async read-back counts as a sync)"
    return (f"syncs per decode step, mean/max: {line}; goal "
            f"{'met' if goal else 'missed' if goal is False else 'not judged'}{where}"), details


def _sync_summary(decode: List[dict], other: List[dict]) -> dict:
    def totals(steps, key):
        return [s.get(key, 0) for s in steps]

    counts = totals(decode, "counter")
    kinds: Dict[str, int] = {}
    ops: Dict[str, int] = {}
    for s in decode:
        for kind, n in s["by_kind"].items():
            kinds[kind] = kinds.get(kind, 0) + n
        for op, n in s["by_op"].items():
            ops[op] = ops.get(op, 0) + n
    out = dict(decode_steps=len(decode), decode_mean=sum(counts) / max(1, len(counts)),
               decode_max=max(counts, default=0), decode_by_kind=kinds,
               decode_by_op=dict(sorted(ops.items(), key=lambda item: -item[1])),
               other_steps=len(other), other_max=max(totals(other, "counter"), default=0))
    if decode and "cuda_sync_warnings" in decode[0]:
        out["decode_cuda_sync_warnings_max"] = max(totals(decode, "cuda_sync_warnings"))
        out["decode_event_waits_max"] = max(totals(decode, "event_waits"))
    return out


def check_readback_busy(env: Env):
    hf = tiny_llama(env)
    ps = prompts()
    reference = build_engine(hf, env.device).generate(
        ps, max_new_tokens=NEW_TOKENS, arrival_steps=list(ARRIVALS), ignore_eos=True)
    details, problems = {}, []
    for mode in ("async", "graphs_async"):
        state = dict(steps=0, still_busy=0, event=None)

        def busy(result, state=state):
            # Was the device still running the last busy kernel when the host came back?
            if state["event"] is not None and not state["event"].query():
                state["still_busy"] += 1
            env.busy(20)
            if env.cuda:
                state["event"] = torch.cuda.Event()
                state["event"].record()
            state["steps"] += 1

        engine = build_engine(hf, env.device, step_callback=busy, **MODES[mode])
        got = engine.generate(ps, max_new_tokens=NEW_TOKENS, arrival_steps=list(ARRIVALS),
                              ignore_eos=True)
        same = sum(a == b for a, b in zip(got, reference))
        details[mode] = dict(steps=state["steps"], device_still_busy_at_next_step=
                             state["still_busy"], same_as_sync=same)
        if same != len(ps):
            problems.append(f"{mode}: {len(ps) - same} of {len(ps)} prompts differ from the "
                            "synchronous engine")
        del engine
    if problems:
        raise CheckFailed("; ".join(problems), details)
    busy_steps = details["async"]["device_still_busy_at_next_step"]
    return (f"async tokens = sync with a 20 ms kernel after every step (device still busy at "
            f"{busy_steps} of {details['async']['steps']} steps)"
            if env.cuda else "async tokens = sync (no busy kernel on a CPU)"), details


ATTENTION_TOLERANCE = {"float32": 5e-5, "float16": 4e-3, "bfloat16": 3e-2}  # atol = rtol
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
#: (query lengths, kv lengths, decode requests): a decode step; decode rows then prefill chunks.
ATTENTION_CASES = {
    "decode": ([1, 1, 1, 1], [1, 16, 45, 130], 4),
    "mixed": ([1, 1, 12, 5], [33, 7, 12, 29], 2),
}


def attention_case(env: Env, dtype, q_lens, kv_lens, *, max_kv: Optional[int] = None,
                   seed: int = 0) -> dict:
    """Paged K/V for ``kv_lens`` (blocks shuffled, NaN in every slot past a request's length,
    room for ``max_kv`` tokens each), queries, and the index tensors, on ``env.device``."""
    gen = torch.Generator().manual_seed(seed)
    room = max(max_kv or 0, max(kv_lens))
    per_request = math.ceil(room / BLOCK_SIZE)
    num_blocks = per_request * len(kv_lens) + 1
    order = torch.randperm(num_blocks, generator=gen)[:per_request * len(kv_lens)]
    table = order.view(len(kv_lens), per_request).to(torch.int32)
    key = torch.full((num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), float("nan"))
    value = torch.full_like(key, float("nan"))
    case = dict(key_cache=key, value_cache=value, block_table=table)
    fill_attention_case(case, q_lens, kv_lens, gen)
    out = {name: t.to(env.device) for name, t in case.items()}
    out["key_cache"] = out["key_cache"].to(dtype)
    out["value_cache"] = out["value_cache"].to(dtype)
    out["query"] = out["query"].to(dtype)
    return out


def fill_attention_case(case: dict, q_lens, kv_lens, gen) -> None:
    """Random values for the first ``kv_lens`` tokens of each request (host tensors)."""
    key, value, table = case["key_cache"], case["value_cache"], case["block_table"]
    key.fill_(float("nan"))
    value.fill_(float("nan"))
    for request, kv in enumerate(kv_lens):
        for position in range(0, kv, BLOCK_SIZE):
            block = int(table[request, position // BLOCK_SIZE])
            used = min(BLOCK_SIZE, kv - position)
            key[block, :used] = torch.randn(used, KV_HEADS, HEAD_DIM, generator=gen)
            value[block, :used] = torch.randn(used, KV_HEADS, HEAD_DIM, generator=gen)
    case["query"] = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen)
    case["cu_query_lengths"] = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32)
    case["kv_seq_lengths"] = torch.tensor(kv_lens, dtype=torch.int32)


def attention_reference(case: dict, q_lens, kv_lens):
    """float64 causal GQA attention over the block table, on the host."""
    query = case["query"].double().cpu()
    key, value = case["key_cache"].double().cpu(), case["value_cache"].double().cpu()
    table = case["block_table"].cpu().long()
    out = torch.zeros_like(query)
    group = HEADS // KV_HEADS
    start = 0
    for request, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        positions = torch.arange(kv)
        blocks = table[request, positions // BLOCK_SIZE]
        k = key[blocks, positions % BLOCK_SIZE].repeat_interleave(group, dim=1)   # [kv, Hq, D]
        v = value[blocks, positions % BLOCK_SIZE].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:start + q], k) * HEAD_DIM ** -0.5
        causal = positions[None, :] <= (kv - q + torch.arange(q))[:, None]        # [q, kv]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out[start:start + q] = torch.einsum("hqk,khd->qhd", probs, v)
        start += q
    return out


def attention_error(got, want, dtype_name: str) -> tuple:
    """``(max abs error, within tolerance)`` of ``got`` (any device) against float64 ``want``."""
    tol = ATTENTION_TOLERANCE[dtype_name]
    got = got.double().cpu()
    if got.isnan().any():
        return float("nan"), False
    error = (got - want).abs()
    return float(error.max()), bool((error <= tol + tol * want.abs()).all())


def run_attention(case: dict, backend: str, q_lens, kv_lens, decode: int, *, out=None,
                  max_seqlen_k: Optional[int] = None):
    return paged_attention(
        case["query"], case["key_cache"], case["value_cache"], case["cu_query_lengths"],
        case["kv_seq_lengths"], case["block_table"], max_seqlen_q=max(q_lens),
        max_seqlen_k=max_seqlen_k or max(kv_lens), num_decode_requests=decode, out=out,
        backend=backend)


def check_paged_attention_dtypes(env: Env):
    details, problems, skipped = {}, [], []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        if dtype is torch.bfloat16 and env.interpreting and not env.cuda:
            skipped.append(name)
            details[name] = "skipped: the Triton interpreter has no bf16 arithmetic"
            continue
        for label, (q_lens, kv_lens, decode) in ATTENTION_CASES.items():
            case = attention_case(env, dtype, q_lens, kv_lens)
            out = torch.full_like(case["query"], float("nan"))
            run_attention(case, env.kernel_backend, q_lens, kv_lens, decode, out=out)
            error, ok = attention_error(out, attention_reference(case, q_lens, kv_lens), name)
            details[f"{name}_{label}_max_abs_error"] = error
            if not ok:
                problems.append(f"{name} {label}: max abs error {error:.3g} over "
                                f"{ATTENTION_TOLERANCE[name]:g}")
    details["backend"] = env.kernel_backend
    if problems:
        raise CheckFailed("; ".join(problems), details)
    worst = {n: max(v for k, v in details.items() if k.startswith(n) and isinstance(v, float))
             for n in ("float32", "float16", "bfloat16") if n not in skipped}
    return (f"{env.kernel_backend} decode + mixed within tolerance; max error "
            + ", ".join(f"{n} {e:.1e}" for n, e in worst.items())
            + (f"; skipped {', '.join(skipped)}" if skipped else "")), details


class Replay:
    """``call`` captured in a CUDA graph and replayed (CUDA), or called again (elsewhere)."""

    def __init__(self, env: Env, call: Callable[[], object]):
        self.call, self.graph = call, None
        if env.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                call()  # warm-up outside the capture: compilation, config lookup
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                call()

    def replay(self) -> None:
        if self.graph is None:
            self.call()
        else:
            self.graph.replay()


def check_paged_attention_graph(env: Env):
    details, problems = {}, []
    dtype = torch.float16 if env.cuda or env.interpreting else torch.float32
    name = str(dtype).replace("torch.", "")
    gen = torch.Generator().manual_seed(7)
    for label, (q_lens, kv_lens, decode) in ATTENTION_CASES.items():
        max_kv = 2 * max(kv_lens)
        case = attention_case(env, dtype, q_lens, kv_lens, max_kv=max_kv)
        out = torch.full_like(case["query"], float("nan"))
        graph = Replay(env, lambda: run_attention(case, env.kernel_backend, q_lens, kv_lens,
                                                  decode, out=out, max_seqlen_k=max_kv))
        errors = []
        for round_ in range(3):
            # New values and longer or shorter KV in place, within the captured bounds.
            lengths = [max(q, int(torch.randint(q, max_kv + 1, (1,), generator=gen)))
                       for q in q_lens]
            host = {k: v.cpu().float() if v.is_floating_point() else v.cpu()
                    for k, v in case.items()}
            fill_attention_case(host, q_lens, lengths, gen)
            for key in ("key_cache", "value_cache", "query", "kv_seq_lengths"):
                case[key].copy_(host[key])
            out.fill_(float("nan"))
            graph.replay()
            error, ok = attention_error(out, attention_reference(case, q_lens, lengths), name)
            errors.append(error)
            if not ok:
                problems.append(f"{label} replay {round_}: max abs error {error:.3g}")
        details[label] = dict(max_abs_errors=errors, max_seqlen_k=max_kv)
    details.update(graph="torch.cuda.CUDAGraph" if env.cuda else "stand-in (called again)",
                   dtype=name, backend=env.kernel_backend)
    if problems:
        raise CheckFailed("; ".join(problems), details)
    return (f"{details['graph']}: decode and mixed, 3 replays each on new values and lengths "
            f"({name}, {env.kernel_backend})"), details


CTX_BLOCK_BYTES = 4 * 2 * 2 * 4 * 2 * 8  # fp32, K and V, 2 layers, 4 tokens, 2 heads, dim 8


def small_context(device):
    return DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
        max_sequence_length=64, buffer_size_gb=40 * CTX_BLOCK_BYTES / 2 ** 30,
        paused_buffer_size_gb=8 * CTX_BLOCK_BYTES / 2 ** 30, block_size_tokens=4,
        max_tokens=64, max_requests=8, unified_memory_level=0, device=device)


def _bookkeeping_by_hand(device) -> dict:
    """Megatron-Core's tests' way: write the bookkeeping tensors by hand, pull them to the host,
    update; what the host and the device show after each."""
    ctx = small_context(device)
    blocks = ctx.block_allocator.allocate_memory_blocks(3)
    ctx.total_request_count, ctx.paused_request_count, ctx.active_token_count = 3, 0, 3
    for row in range(3):
        ctx.request_ids[row] = 10 + row
        ctx.request_query_lengths[row] = 1
        ctx.request_kv_block_counts[row] = 1
        ctx.request_last_kv_block_id[row] = int(blocks[row])
        ctx.request_to_kv_block_ids[row, 0] = int(blocks[row])
    ctx.request_metadata["temperature"][:3] = 0.5
    ctx.pull_bookkeeping_from_device()
    seen = dict(ids_after_pull=ctx.host_request_ids().tolist(),
                table_after_pull=ctx.block_table_host[:3, 0].tolist(), blocks=blocks.tolist())
    free = ctx.block_allocator.total_avail
    ctx.update_requests(torch.tensor([1, 0, 1]), torch.tensor([5, 6, 7], device=ctx.device))
    seen.update(ids_after_update=ctx.host_request_ids().tolist(),
                blocks_freed=ctx.block_allocator.total_avail - free,
                tokens_after_update=ctx.token_to_input_ids[:2].tolist(),
                temperature_after_update=ctx.request_metadata["temperature"][:2].tolist())
    ctx.add_request(DynamicInferenceRequest(
        request_id=3, prompt_tokens=torch.arange(2),
        sampling_params=SamplingParams(num_tokens_to_generate=2)))
    try:
        ctx.pull_bookkeeping_from_device()
        seen["pull_after_add"] = "accepted"
    except RuntimeError as exc:
        seen["pull_after_add"] = "refused: " + str(exc).split(";")[0]
    return seen


def check_pull_bookkeeping(env: Env):
    got = _bookkeeping_by_hand(env.device)
    want = _bookkeeping_by_hand("cpu")
    details = dict(device=got, cpu=want)
    expected = dict(ids_after_pull=[10, 11, 12], ids_after_update=[10, 12], blocks_freed=1,
                    tokens_after_update=[5, 7], temperature_after_update=[0.5, 0.5])
    problems = [f"{k}: {got[k]} (expected {v})" for k, v in expected.items() if got[k] != v]
    problems += [f"{k}: device {got[k]} vs cpu {want[k]}" for k in got
                 if k != "pull_after_add" and got[k] != want[k]]
    if env.cuda and not got["pull_after_add"].startswith("refused"):
        problems.append("a pull after add_request was accepted (the host changed in between)")
    if problems:
        raise CheckFailed("; ".join(problems), details)
    return ("hand-written device tensors pulled to the host, then updated: as on a CPU"
            + ("; a pull after add_request refused" if env.cuda else "")), details


#: (prompt length, arrival step, tokens to generate) of the pinned ring workload.
RING_REQUESTS = ((5, 0, 6), (9, 0, 3), (3, 1, 8), (14, 1, 4), (7, 2, 5), (2, 3, 7), (11, 5, 3),
                 (6, 6, 6), (4, 8, 4), (8, 9, 5))
RING_STEPS = 20


def _drive_ring(ctx, *, tokens: Optional[list] = None, busy: Callable[[], None] = lambda: None):
    """The ring workload on ``ctx``: per step its active ids, the tokens it sampled, and clones
    of the step's arrays (device tensors, compared once the device is done)."""
    left = {}
    record = []
    for step in range(RING_STEPS):
        for rid, (length, arrival, gen) in enumerate(RING_REQUESTS):
            if arrival == step:
                ctx.add_request(DynamicInferenceRequest(
                    request_id=rid, prompt_tokens=torch.arange(100 + rid, 100 + rid + length),
                    sampling_params=SamplingParams(num_tokens_to_generate=gen)))
                left[rid] = gen
        if not ctx.total_request_count - ctx.paused_request_count:
            record.append(None)
            continue
        busy()  # the uploads of this step queue behind it
        ctx.initialize_attention_state()
        n = ctx.active_token_count
        paused, total = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids()[paused:total].tolist()
        input_ids, positions = ctx.current_input_and_position_ids()
        arrays = [input_ids[0, :n], positions[0, :n], ctx.token_to_block_idx[:n],
                  ctx.token_to_local_position_within_kv_block[:n],
                  ctx.request_to_kv_block_ids[paused:total]]
        step_tokens = [(rid * 7 + step) % 256 for rid in ids]
        if tokens is not None:
            new = tokens[step]
        else:
            new = torch.tensor(step_tokens, dtype=torch.int64, device=ctx.device)
        for rid in ids:
            left[rid] -= 1
        mask = torch.tensor([left[rid] > 0 for rid in ids])
        record.append(dict(ids=ids, tokens=step_tokens, arrays=[a.clone() for a in arrays]))
        ctx.update_requests(mask, new)
    return record


def check_pinned_ring(env: Env):
    want = _drive_ring(small_context("cpu"))
    # The step's tokens uploaded before the run: an upload from pageable memory would wait
    # for the busy kernels and take the host's lead away.
    tokens = [None if step is None else torch.tensor(step["tokens"], dtype=torch.int64).to(
        env.device) for step in want]
    env.sync()
    ctx = small_context(env.device)
    got = _drive_ring(ctx, tokens=tokens, busy=lambda: env.busy(5))
    still_busy = None
    if env.cuda:
        event = torch.cuda.Event()
        event.record()
        still_busy = not event.query()
    env.sync()
    problems = []
    names = ("input_ids", "position_ids", "token_to_block_idx",
             "token_to_local_position_within_kv_block", "request_to_kv_block_ids")
    for step, (a, b) in enumerate(zip(got, want)):
        if (a is None) != (b is None):
            problems.append(f"step {step}: active on one side only")
            continue
        if a is None:
            continue
        if a["ids"] != b["ids"]:
            problems.append(f"step {step}: active ids {a['ids']} vs {b['ids']}")
        for name, x, y in zip(names, a["arrays"], b["arrays"]):
            if not torch.equal(x.cpu(), y.cpu()):
                problems.append(f"step {step}: {name} differs")
    steps = sum(s is not None for s in want)
    details = dict(steps=steps, requests=len(RING_REQUESTS), device_still_busy_at_end=still_busy,
                   mismatches=len(problems))
    if problems:
        raise CheckFailed("; ".join(problems[:6]), details)
    return ((f"{steps} steps with a 5 ms kernel queued before each: every step's arrays = a CPU "
             f"context's (device still busy when the host finished: {still_busy})")
            if env.cuda else f"{steps} steps: arrays = a CPU context's (no busy kernel on a CPU)"
            ), details


CHECK_FUNCTIONS: Dict[str, Callable[[Env], tuple]] = {
    "engine_cuda": check_engine_cuda,
    "engine_modes": check_engine_modes,
    "engine_syncs": check_engine_syncs,
    "readback_busy": check_readback_busy,
    "paged_attention_dtypes": check_paged_attention_dtypes,
    "paged_attention_graph": check_paged_attention_graph,
    "pull_bookkeeping": check_pull_bookkeeping,
    "pinned_ring": check_pinned_ring,
}
