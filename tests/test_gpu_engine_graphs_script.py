"""bench/gpu_engine_graphs.py on a CPU: its arguments, its refusal without CUDA, and the whole
pipeline (engine eager, engine with graph dimensions, transformers' static-cache generate) on
the --tiny model. Numbers are never asserted; what the results file holds is."""

import json

import gpu_engine_graphs as geg  # bench/, on sys.path through pyproject's pytest `pythonpath`
import pytest
import torch


def test_defaults_are_the_issue_workload():
    args = geg.parse_args([])
    assert args.batches == [1, 16, 64, 256]
    assert args.modes == ["eager", "graphs", "graphs_async", "hf"]
    assert args.dtype == torch.bfloat16 and args.device == "cuda"
    shape = geg.MODEL_1B
    assert (shape["num_hidden_layers"], shape["hidden_size"], shape["num_attention_heads"],
            shape["num_key_value_heads"]) == (16, 2048, 32, 8)
    # About 1B parameters (untied embedding and head).
    h, f, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], 16
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + 2 * v * h + h
    assert 0.9e9 < params < 1.3e9


@pytest.mark.parametrize("argv,message", [
    (["--batches", "1,x"], "must be comma-separated integers"),
    (["--batches", "0"], "must be positive integers"),
    (["--modes", "eager,fast"], "unknown ['fast']"),
    (["--new-tokens", "1"], "must be >= 2 for the hf mode"),
    (["--max-tokens", "100"], "must be >= the largest batch 256"),
    (["--prompt-len", "0"], "--prompt-len=0 must be >= 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        geg.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_cuda_without_a_gpu(capsys, tmp_path):
    assert geg.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_tiny_pipeline_on_cpu(tmp_path):
    out = tmp_path / "engine_graphs.json"
    assert geg.main(["--tiny", "--device", "cpu", "--batches", "3", "--new-tokens", "3",
                     "--prompt-len", "5", "--max-tokens", "64", "--buffer-gb", "0.01",
                     "--num-cuda-graphs", "2", "--out", str(out),
                     "--table-file", str(tmp_path / "table.txt")]) == 0
    data = json.loads(out.read_text())
    runs = {run["mode"]: run for run in data["runs"]}
    assert set(runs) == {"eager", "graphs", "graphs_async", "hf"}
    for run in runs.values():
        assert "error" not in run, run
        assert run["batch"] == 3 and run["decode_tokens"] == 3 * run["decode_steps"] > 0
        assert run["tokens_per_s"] > 0 and run["step_ms_median"] > 0
    assert runs["eager"]["graph_shape_steps"] == 0 and runs["eager"]["ladder"] == []
    # Every decode step of 3 requests fits the decode graph of 4 slots (max_requests 4).
    assert runs["graphs"]["graph_shape_steps"] >= runs["graphs"]["decode_steps"]
    assert runs["graphs"]["ladder"]
    # fp32: the engine's greedy tokens are transformers' (and the graph padding changes none).
    assert runs["graphs"]["same_tokens_as_eager"] == 1.0
    assert runs["hf"]["same_tokens_as_eager"] == 1.0
    # Async scheduling: the same tokens, read one step late.
    assert runs["graphs_async"]["same_tokens_as_eager"] == 1.0
    assert runs["graphs_async"]["graph_shape_steps"] >= runs["graphs_async"]["decode_steps"]
    assert "mode" in (tmp_path / "table.txt").read_text()
    # One engine per (mode, batch): the warm-up run replayed graphs too, the timed run did.
    assert runs["graphs"]["graph_info"]["graph_replays_this_run"] > 0
    assert runs["eager"]["graph_info"]["graph_replays_this_run"] == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_engine_modes_run_first_and_transformers_last():
    assert geg.run_order([1, 64], ["eager", "hf", "graphs"]) == [
        (1, "eager"), (1, "graphs"), (64, "eager"), (64, "graphs"), (1, "hf"), (64, "hf")]


def test_the_static_cache_baseline_does_not_compile(monkeypatch):
    """transformers' static-cache generate compiles the forward per batch shape on CUDA unless
    told not to (about a minute each): every generate call passes disable_compile=True."""
    calls = []

    class Model:
        def generate(self, **kwargs):
            calls.append(kwargs)
            n = kwargs["max_new_tokens"]
            return torch.zeros(2, 3 + n, dtype=torch.int64)

    args = geg.parse_args(["--tiny", "--device", "cpu", "--new-tokens", "3"])
    numbers = geg.run_hf(Model(), [[1, 2, 3], [4, 5, 6]], args, torch.device("cpu"))
    assert calls and all(c["disable_compile"] is True and c["cache_implementation"] == "static"
                         for c in calls)
    assert numbers["decode_steps"] == 2 and len(numbers["outputs"]) == 2
