"""The engine with CUDA graphs on (``num_cuda_graphs``): every graph of the ladder is captured on
the capture dummies, the steps the context puts in a graph replay it, the others run eagerly,
and the tokens and every step's logits equal transformers' (engine/graphs.py).

On a CPU the stand-in runner replays (the forward on the static inputs under a check of every
launch against the capture's, tests/e2e/test_graph_freeze.py; the output in a static buffer per
graph; every input checked to be at its captured address); the ``gpu`` cases run
``torch.cuda.CUDAGraph`` capture and replay on a CUDA device."""

from __future__ import annotations

import contextlib

import pytest
import torch
from e2e_helpers import (
    DEVICES,
    FP32_LOGITS_ATOL,
    assert_matches_transformers,
    assert_pressure_stats,
    assert_requests_match_greedy,
    build_engine,
    case_engine_sizes,
    greedy_requests,
    make_prompts,
    pressure_workload,
    refuse_torch_references,
    tiny_llama,
    worst_logit_error,
)
from test_llama_engine import BASE_GENS, BASE_LENGTHS
from triton_marks import needs_triton

from dynctx.context import SamplingParams
from dynctx.engine import Engine
from dynctx.engine.graphs import CudaGraphRunner, StandInGraphRunner
from dynctx.engine.launch_tape import LaunchRecorder
from dynctx.engine.replay_inputs import GraphStepContext, static_plan_values

CASE = dict(block_size=16, blocks=14, paused_blocks=3, max_tokens=32, max_requests=8, scale=1)


def graph_engine(hf, device="cpu", **kwargs):
    kwargs.setdefault("num_cuda_graphs", 4)
    return build_engine(hf, **case_engine_sizes(CASE),
                        kernel_backend="torch" if device == "cpu" else "triton",
                        attention_backend="torch_static", record_logits=True, **kwargs)


@pytest.mark.parametrize("mixed", [2, None], ids=["mixed", "decode-only"])
def test_graphs_replay_under_pressure_and_match_transformers(mixed):
    hf = tiny_llama()
    prompts, requests, arrivals = pressure_workload(hf, CASE, BASE_LENGTHS, BASE_GENS)
    steps = []

    def record(step):
        ctx = engine.context
        if not step.idle:
            steps.append((ctx.padded_batch_dimensions, ctx.using_cuda_graph_this_step()))

    engine = graph_engine(hf, cuda_graph_mixed_prefill_count=mixed, step_callback=record)
    runner = engine.graph_runner
    ladder = engine.context.cuda_graph_batch_dimensions_list
    assert isinstance(runner, StandInGraphRunner)
    assert set(runner.graphs) == set(ladder) and runner.captures == len(ladder)
    assert engine.context.total_request_count == 0  # the capture dummies are gone

    results = engine.generate_requests(requests, arrival_steps=arrivals)

    assert_pressure_stats(engine.stats, results)
    # Every step in a graph replayed it, every other step ran eagerly, nothing else.
    expected = {}
    for dims, in_graph in steps:
        if in_graph:
            expected[dims] = expected.get(dims, 0) + 1
    assert dict(runner.replays) == expected
    assert runner.eager_steps == sum(not in_graph for _, in_graph in steps)
    assert sum(expected.values()) >= len(steps) // 2
    assert any(dims.prefill_req_count == 0 for dims in expected), "decode steps use graphs"
    if mixed is not None:
        assert any(dims.prefill_req_count for dims in expected), "mixed steps use graphs"
    assert_requests_match_greedy(hf, requests, prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"


def test_suspend_releases_graphs_and_resume_captures_them_again():
    hf = tiny_llama()
    prompts = make_prompts([5, 9, 3, 12], hf.config.vocab_size)
    gens = [12, 8, 14, 6]
    engine = graph_engine(hf)
    runner = engine.graph_runner
    graphs = len(runner.graphs)
    for request in greedy_requests(prompts, gens):
        engine.add_request(request)
    for _ in range(4):
        engine.step()
    replays_before = sum(runner.replays.values())
    assert replays_before > 0
    engine.suspend()
    assert runner.graphs == {}
    engine.resume()
    assert len(runner.graphs) == graphs and runner.captures == 2 * graphs
    results = sorted(engine.run(), key=lambda r: r.request_id)
    assert sum(runner.replays.values()) > replays_before
    for prompt, gen, result in zip(prompts, gens, results):
        assert result.finish_reason == "length"
    assert_requests_match_greedy(hf, greedy_requests(prompts, gens), prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"


def test_replay_writes_one_static_buffer_per_graph():
    hf = tiny_llama()
    engine = graph_engine(hf, cuda_graph_mixed_prefill_count=None)
    runner = engine.graph_runner
    outputs = {}
    original_replay = runner._replay

    def replay(dims, graph):
        out = original_replay(dims, graph)
        outputs.setdefault(dims, set()).add(out.data_ptr())
        return out

    runner._replay = replay
    engine.generate(make_prompts([4, 6, 3], hf.config.vocab_size), max_new_tokens=6,
                    ignore_eos=True)
    assert outputs and all(len(addresses) == 1 for addresses in outputs.values())
    assert {next(iter(a)) for a in outputs.values()} == \
        {runner.graphs[d].output.data_ptr() for d in outputs}


def test_a_moved_input_is_refused_before_the_replay(monkeypatch):
    hf = tiny_llama()
    engine = graph_engine(hf)
    prompts = make_prompts([4, 6], hf.config.vocab_size)
    engine.generate(prompts, max_new_tokens=3, ignore_eos=True)
    ctx = engine.context
    # What a re-allocation would do: the step's position ids now live at another address.
    moved = ctx.token_to_pos_ids.clone()
    monkeypatch.setattr(type(ctx), "token_to_pos_ids", property(lambda self: moved))
    with pytest.raises(RuntimeError, match="token_to_pos_ids"):
        engine.generate(prompts, max_new_tokens=3, ignore_eos=True)


def test_prompt_log_prob_steps_run_eagerly_and_decode_steps_replay():
    hf = tiny_llama()
    engine = graph_engine(hf)
    runner = engine.graph_runner
    assert runner.last_token_only
    params = SamplingParams(temperature=1.0, top_k=1, return_log_probs=True)
    engine.generate(make_prompts([5, 7], hf.config.vocab_size), max_new_tokens=5,
                    sampling_params=params, ignore_eos=True)
    # The prefill step wants every token's logits (prompt log probs): eager; decodes replay.
    assert runner.eager_steps >= 1
    assert sum(runner.replays.values()) >= 4


def test_graphs_off_runs_every_forward_eagerly():
    hf = tiny_llama()
    engine = graph_engine(hf, cuda_graphs=False)
    assert engine.graph_runner is None
    assert engine.context.cuda_graph_batch_dimensions_list
    assert build_engine(hf, **case_engine_sizes(CASE)).graph_runner is None  # no num_cuda_graphs


def test_graph_step_context_reports_static_plan_values():
    hf = tiny_llama()
    engine = graph_engine(hf)
    ctx = engine.context
    # Megatron's graphed key bound, capped at what a block-table row holds (here the context's
    # rows hold 13 blocks of 16 tokens, fewer than max_sequence_length=256 needs).
    key_bound = min(ctx.max_sequence_length, ctx.max_kv_block_count * ctx.block_size_tokens)
    assert key_bound < ctx.max_sequence_length
    for dims in ctx.cuda_graph_batch_dimensions_list:
        max_q, max_k, decode = static_plan_values(ctx, dims)
        assert max_k == key_bound
        if dims.prefill_req_count == 0:
            assert (max_q, decode) == (1, dims.decode_req_count)
        else:
            assert (max_q, decode) == (max(2, dims.token_count), 0)
    dims = ctx.cuda_graph_batch_dimensions_list[0]
    ctx.initialize_attention_state(construct_graph_dimensions=dims)
    view = GraphStepContext(ctx, dims)
    assert view.active_attn_metadata.block_table is ctx.active_attn_metadata.block_table
    assert view.active_attn_metadata.max_seqlen_k == key_bound
    assert view.padded_active_token_count == dims.token_count
    with pytest.raises(AttributeError, match="read-only"):
        view.chunked_prefill_request_id = 3
    logits = torch.randn(1, dims.token_count, 11)
    assert view.last_token_logits(logits).shape == (dims.req_count, 11)
    with pytest.raises(ValueError, match="token rows"):
        view.last_token_logits(logits[:, :-1])
    ctx.reset()


def test_cuda_graph_runner_refuses_a_cpu_context():
    hf = tiny_llama()
    engine = graph_engine(hf)
    with pytest.raises(ValueError, match="CUDA context"):
        CudaGraphRunner(engine.model, engine.context, last_token_only=True)


@pytest.mark.parametrize("device", [p for p in DEVICES if p.id == "cuda"])
def test_cuda_graphs_capture_replay_and_match_eager(device):
    """On CUDA: torch.cuda.CUDAGraph capture and replay give the eager engine's tokens."""
    hf = tiny_llama(device=device)
    prompts, requests, arrivals = pressure_workload(hf, CASE, BASE_LENGTHS, BASE_GENS)
    results = {}
    for graphs in (True, False):
        engine = graph_engine(hf, device=device, cuda_graphs=graphs)
        results[graphs] = engine.generate_requests(
            greedy_requests(prompts, BASE_GENS), arrival_steps=arrivals)
        if graphs:
            assert isinstance(engine.graph_runner, CudaGraphRunner)
            assert sum(engine.graph_runner.replays.values()) > 0
    for with_graphs, eager in zip(results[True], results[False]):
        assert with_graphs.generated_tokens == eager.generated_tokens
    assert_requests_match_greedy(hf, requests, prompts, results[True])


def test_graph_attention_backend_keeps_explicit_choices_and_avoids_flashinfer(monkeypatch):
    from dynctx.engine import replay_inputs

    choose = replay_inputs.graph_attention_backend

    cpu = torch.device("cpu")
    assert choose("auto", cpu, 16, torch.float32) == "torch_static"
    assert choose("flashinfer", cpu, 16, torch.bfloat16) == "flashinfer"
    monkeypatch.setattr(replay_inputs, "resolve_attention_backend", lambda *args: "flashinfer")
    monkeypatch.setattr(replay_inputs, "flash_attn_available",
                        lambda device, block: block % 256 == 0)
    assert choose("auto", cpu, 256, torch.bfloat16) == "flash_attn"
    assert choose("auto", cpu, 16, torch.bfloat16) == "torch_static"


class _SyncingLlama:
    """A Llama adapter whose forward reads a value back (as ``.item()`` would on a GPU)."""

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.vocab_size

    def forward(self, ctx, *, last_token_only=True):
        ctx.active_attn_metadata.kv_seq_lengths.max().item()
        return self.model.forward(ctx, last_token_only=last_token_only)


def test_a_forward_with_a_host_sync_is_refused_at_capture_naming_the_line():
    hf = tiny_llama()
    engine = graph_engine(hf, cuda_graphs=False)
    with pytest.raises(RuntimeError, match=r"cannot be captured.*test_graph_replay\.py:\d+ "
                                           r"\(forward\): item\(\)"):
        Engine(_SyncingLlama(engine.model), engine.context)
    # The eager engine runs it.
    Engine(_SyncingLlama(engine.model), engine.context, cuda_graphs=False)


def test_the_hybrid_forward_is_refused_at_capture_naming_its_host_syncs():
    from test_nemotron_h import build_engine as build_hybrid
    from test_nemotron_h import tiny_nemotron_h

    hf = tiny_nemotron_h()
    with pytest.raises(RuntimeError, match=r"cannot be captured.*models/nemotron_h\.py:\d+"):
        build_hybrid(hf, block_size=16, blocks=8, paused_blocks=2, max_tokens=32,
                     max_requests=8, kernel_backend="torch", num_cuda_graphs=2)


def test_with_validate_the_graphs_capture_every_token_logits_and_match_transformers():
    """``validate=True`` makes the engine take every token's logits (it checks them outside
    the forward): the graphs are captured in that mode and replay it."""
    hf = tiny_llama()
    prompts = make_prompts([5, 9, 3], hf.config.vocab_size)
    gens = [6, 4, 7]
    engine = graph_engine(hf, validate=True)
    runner = engine.graph_runner
    assert not runner.last_token_only
    results = engine.generate_requests(greedy_requests(prompts, gens))
    assert engine.graph_replays > 0 and runner.eager_steps == engine.stats.forward_steps - \
        engine.graph_replays
    assert_requests_match_greedy(hf, greedy_requests(prompts, gens), prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"


@pytest.mark.interpreter
@needs_triton
def test_graphs_replay_the_triton_kernels(monkeypatch):
    """The context's Triton kernels inside the graphed forward (the interpreter on a CPU, the
    CUDA graph runner on a GPU); the torch references refuse to run."""
    refuse_torch_references(monkeypatch, [
        ("dynctx.kernels.kv_append", "kv_append_ref"),
        ("dynctx.kernels.rope", "fused_qk_rope_ref"),
        ("dynctx.kernels.step_metadata", "step_metadata_ref"),
        ("dynctx.kernels.compaction", "compact_requests_ref"),
        ("dynctx.kernels.last_token_logits", "last_token_logits_ref")])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = tiny_llama(seed=21, vocab=128, hidden=32, intermediate=64, max_positions=64,
                    device=device)
    prompts = make_prompts([3, 20, 1], hf.config.vocab_size, seed=22)
    gens = [5, 4, 5]
    engine = build_engine(hf, block_size=16, blocks=6, paused_blocks=1, max_tokens=16,
                          max_requests=4, kernel_backend="triton", attention_backend="torch_static",
                          num_cuda_graphs=2, record_logits=True)
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0, 2])
    assert engine.graph_replays > 0
    assert_matches_transformers(hf.cpu(), prompts, gens, results)


def test_cuda_runner_protocol_with_torch_cuda_faked(monkeypatch):
    """The CUDA runner's control flow on a CPU, torch.cuda's graph API faked: warm-up runs on a
    side stream (the first one checked for host syncs), every graph is captured into the one
    shared pool, and a graph step replays its graph and returns its output's real rows, whose
    tokens are transformers'. The fake graph records the captured forward's launches
    (``LaunchRecorder``) and its replay runs the forward again under their check, writing into
    the captured output, as a CUDA graph writes into its own buffers. (The real capture runs
    only on a GPU: test_cuda_graphs_capture_replay_and_match_eager.)"""
    from dynctx.engine import graphs as graphs_module

    events = []
    calls = []   # (view, last_token_only, output) of every forward, in order

    class FakeStream:
        def __init__(self, device=None):
            events.append("stream")

        def wait_stream(self, other):
            pass

    class FakeGraph:
        tape, captured = None, None

        def replay(self):
            events.append(("replay", id(self)))
            view, last_token_only, output = self.captured
            with LaunchRecorder(self.tape, label="the fake CUDA graph"):
                fresh = model.forward(view, last_token_only=last_token_only)
            output.copy_(fresh)

    @contextlib.contextmanager
    def fake_stream(stream):
        events.append("side stream")
        yield

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):
        events.append(("capture", id(graph), pool))
        recorder = LaunchRecorder()
        with recorder:
            yield
        graph.tape, graph.captured = recorder.launches, calls[-1]

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    checked = []
    original_refuse = graphs_module.refuse_host_syncs
    monkeypatch.setattr(graphs_module, "refuse_host_syncs",
                        lambda dims: checked.append(dims) or original_refuse(dims))

    hf = tiny_llama()
    engine = graph_engine(hf, cuda_graphs=False)
    forwards = []
    model = engine.model

    class CountingModel:
        vocab_size = model.vocab_size

        def forward(self, ctx, *, last_token_only=True):
            forwards.append(type(ctx).__name__)
            output = model.forward(ctx, last_token_only=last_token_only)
            calls.append((ctx, last_token_only, output))
            return output

    # The device check refuses a CPU context: build the runner past it.
    runner = CudaGraphRunner.__new__(CudaGraphRunner)
    graphs_module.GraphRunner.__init__(runner, CountingModel(), engine.context,
                                        last_token_only=True)
    runner.warmup_steps, runner._pool = 2, None
    runner.capture_all()
    ladder = engine.context.cuda_graph_batch_dimensions_list
    captures = [e for e in events if isinstance(e, tuple) and e[0] == "capture"]
    assert len(captures) == len(ladder) and {pool for _, _, pool in captures} == {"pool"}
    assert sorted(checked) == sorted(ladder)
    # Per graph: two warm-up forwards and the captured one, all through the graph's view.
    assert forwards == ["GraphStepContext"] * 3 * len(ladder)
    assert events.count("side stream") == len(ladder)

    engine.graph_runner = runner
    prompts, gens = make_prompts([4, 6, 3], hf.config.vocab_size), [5, 3, 6]
    results = engine.generate_requests(greedy_requests(prompts, gens))
    replayed = [e for e in events if isinstance(e, tuple) and e[0] == "replay"]
    assert len(replayed) == sum(runner.replays.values()) > 0
    assert_requests_match_greedy(hf, greedy_requests(prompts, gens), prompts, results)
    assert {graph_id for _, graph_id in replayed} <= {id(g.graph) for g in runner.graphs.values()}
    runner.release()
    assert runner.graphs == {} and runner._pool is None


@pytest.mark.parametrize("rope, fused", [("cos_sin", False), ("table", True), ("cos_sin", True)],
                         ids=["cos_sin", "fused_table", "fused_cos_sin"])
def test_every_llama_rope_path_captures_without_host_syncs_and_matches(rope, fused):
    hf = tiny_llama()
    prompts = make_prompts([5, 9], hf.config.vocab_size)
    gens = [5, 4]
    engine = graph_engine(hf, rope=rope, fused_rope_kv_append=fused)
    assert engine.graph_runner.captures == len(engine.context.cuda_graph_batch_dimensions_list)
    results = engine.generate_requests(greedy_requests(prompts, gens))
    assert engine.graph_replays > 0
    assert_matches_transformers(hf, prompts, gens, results)


def test_mla_dense_forward_replays_and_moe_routing_is_refused():
    """DeepSeek-V2 (MLA): the dense model captures and replays with the eager engine's tokens;
    the MoE routing reads the chosen experts back to the host (models/deepseek.py), so capture
    refuses it."""
    from test_deepseek_mla import build_engine as build_mla
    from test_deepseek_mla import tiny_deepseek

    sizes = dict(block_size=16, blocks=14, paused_blocks=3, max_tokens=32, max_requests=8,
                 kernel_backend="torch", num_cuda_graphs=4)
    prompts = make_prompts([5, 17, 3], 128)
    hf = tiny_deepseek(moe=False)
    outputs = {}
    for graphs in (True, False):
        engine = build_mla(hf, cuda_graphs=graphs, **sizes)
        outputs[graphs] = engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
        assert (engine.graph_replays > 0) == graphs
    assert outputs[True] == outputs[False]
    with pytest.raises(RuntimeError, match=r"cannot be captured.*models/deepseek\.py:\d+"):
        build_mla(tiny_deepseek(moe=True), **sizes)
