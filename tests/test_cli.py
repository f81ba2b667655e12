"""The command line as a user meets it: plain help with defaults and a description for every
command, the program's own name, one-line errors with exit code 2 for every bad demo flag,
``autotune show`` readable and quiet under ``| head``, the demo's missing-extra message, its
progress bars (on a terminal only) and its plot of long runs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynctx import __main__ as cli_main
from dynctx import _cli_common, cli_autotune, cli_demo, demo_plot, demo_run


def _help(parser: argparse.ArgumentParser) -> str:
    return parser.format_help()


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.extend(action.choices.values())
    return found


def test_help_texts_are_plain_text():
    parsers = [cli_main.build_parser("python -m dynctx"), cli_demo.build_parser(),
               cli_autotune.build_parser()]
    parsers += _subparsers(parsers[-1])
    for parser in parsers:
        text = _help(parser)
        assert "``" not in text and ":class:" not in text, text


def test_every_demo_flag_has_help_and_states_its_default():
    parser = cli_demo.build_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, False):
            rendered = parser.formatter_class("x")._get_help_string(action) % vars(action)
            assert "default" in rendered, f"{action.option_strings}: {rendered!r}"
    text = _help(parser)
    assert "(default: 24)" in text and "(default: demo.png)" in text


def test_every_command_has_a_description():
    top = cli_main.build_parser("python -m dynctx")
    assert top.description
    for name in cli_main.COMMANDS:
        assert name in _help(top)
    commands = [cli_demo.build_parser(), cli_autotune.build_parser()]
    commands += _subparsers(commands[-1])
    for parser in commands:
        first_line = (parser.description or "").strip().split("\n")[0]
        assert first_line, f"{parser.prog} --help has no description"
        # usage, then the description, then the options
        assert _help(parser).split("\n\n")[1].startswith(first_line), parser.prog
    for name, sub in zip(("tune", "show", "check", "bench"), _subparsers(commands[1])):
        assert sub.description == cli_autotune.DESCRIPTIONS[name]


def test_demo_attention_choices_are_the_models_backends():
    from dynctx.models.paged_attention import BACKENDS

    assert set(cli_demo.ATTENTION_BACKENDS) == set(BACKENDS)
    action = next(a for a in cli_demo.build_parser()._actions
                  if a.dest == "attention_backend")
    assert set(action.choices) == set(BACKENDS)
    assert "FlashInfer, then flash-attn" not in action.help


@pytest.fixture
def plain_env(monkeypatch):
    """No backend or interpreter settings from the caller's environment, no torchrun."""
    for name in ("TRITON_INTERPRET", "DYNCTX_KERNEL_BACKEND", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


BAD_DEMO_FLAGS = [
    (["--requests", "0"], "argument --requests: 0 is not an integer >= 1"),
    (["--requests", "-3"], "argument --requests: -3 is not an integer >= 1"),
    (["--requests", "two"], "argument --requests: 'two' is not an integer >= 1"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not an integer >= 1"),
    (["--max-tokens", "0"], "argument --max-tokens: 0 is not an integer >= 1"),
    (["--max-requests", "0"], "argument --max-requests: 0 is not an integer >= 1"),
    (["--block-size", "0"], "argument --block-size: 0 is not an integer >= 1"),
    (["--paused-blocks", "-1"], "argument --paused-blocks: -1 is not an integer >= 0"),
    (["--shared-prefix", "-1"], "argument --shared-prefix: -1 is not an integer >= 0"),
    (["--seed", "-1"], "argument --seed: -1 is not an integer >= 0"),
    (["--threads", "-1"], "argument --threads: -1 is not an integer >= 0"),
    # torch.set_num_threads(100000) ended the process with a segmentation fault.
    (["--threads", "100000"], f"--threads 100000 is more than the {os.cpu_count()} CPUs here"),
    (["--tensor-parallel-size", "0"], "argument --tensor-parallel-size: 0 is not an integer"),
    (["--arrival-every", "nan"], "argument --arrival-every: 'nan' is not a finite number >= 0"),
    (["--arrival-every", "-1"], "argument --arrival-every: -1 is not a finite number >= 0"),
    # A traceback before: the arrival steps overflowed int64 to -2**63.
    (["--arrival-every", "1e308"], "--arrival-every 1e+308 with --requests 24 spreads arrivals "
                                   "over more than 1e+12 steps"),
    (["--buffer-size-gb", "0"], "argument --buffer-size-gb: 0 is not a finite number > 0"),
    (["--paused-buffer-size-gb", "inf"], "'inf' is not a finite number >= 0"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--attention-backend", "flash"], "argument --attention-backend: invalid choice"),
    (["--buffer-blocks", "1"], "--buffer-blocks 1 with --paused-blocks 3 leaves -2 blocks for "
                               "running requests; the longest request (a 48-token prompt + "
                               "--max-new-tokens 32) needs 5 blocks of --block-size 16: use "
                               "--buffer-blocks 8 or more"),
    (["--buffer-blocks", "7"], "--buffer-blocks 7 with --paused-blocks 3 leaves 4 blocks"),
    (["--buffer-size-gb", "5e-5"], "--buffer-size-gb 5e-05 (5 blocks of 8 KiB and the padding "
                                   "block) with --paused-blocks 3 leaves 2 blocks for running "
                                   "requests; the longest request (a 48-token prompt + "
                                   "--max-new-tokens 32) needs 5 blocks of --block-size 16: use "
                                   "--buffer-size-gb 6.87e-05 or more"),
    (["--paused-buffer-size-gb", "0.0001"], "--buffer-blocks 13 with --paused-buffer-size-gb "
                                            "0.0001 (13 blocks of 8 KiB) leaves 0 blocks"),
    (["--hidden", "63"], "--hidden 63 is not a multiple of --heads 4"),
    (["--hidden", "12"], "--hidden 12 / --heads 4 = 3 is the head size, which must be even"),
    (["--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4"),
    (["--vocab", "3"], "--vocab 3 is below 4"),
    (["--max-seq", "32"], "--max-seq 32 leaves no room for a prompt before --max-new-tokens 32"),
    (["--max-requests", "64"], "--max-requests 64 exceeds --max-tokens 32"),
    (["--tensor-parallel-size", "3"], "--heads 4 is not divisible by --tensor-parallel-size 3"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size=2 needs one process per rank: "
                                      "launch with PYTHONSAFEPATH=1 python -P -m "
                                      "torch.distributed.run --nproc-per-node 2"),
    (["--async-scheduling", "--dtype", "bf16"], "--async-scheduling with --dtype bf16"),
    (["--plot", "no_such_folder/x.png"], "--plot no_such_folder/x.png: the folder"),
    (["--device", "nonsense"], "--device nonsense is not a torch device"),
    (["--kernel-backend", "triton"], "--kernel-backend triton on device cpu: the Triton "
                                     "kernels run on CUDA, or on a CPU under "
                                     "TRITON_INTERPRET=1"),
    (["--attention-backend", "triton"], "--attention-backend triton: attention backend "
                                        "'triton' cannot run"),
    (["--attention-backend", "flashinfer"], "--attention-backend flashinfer: attention "
                                            "backend 'flashinfer' runs fp16/bf16"),
]


@pytest.mark.parametrize("argv, message", BAD_DEMO_FLAGS,
                         ids=[" ".join(argv) for argv, _ in BAD_DEMO_FLAGS])
def test_a_bad_demo_flag_is_one_line_and_exit_code_2(plain_env, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli_demo.main(argv, prog="dynctx demo")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynctx demo: error: "), err
    assert message in err, err
    assert err.rstrip().endswith("(see 'dynctx demo --help')")
    assert "paused_buffer_size_gb" not in err and "Traceback" not in err


def test_a_model_too_large_for_memory_is_a_flag_error(plain_env, monkeypatch, capsys):
    """torch's allocation failure building the random model was a traceback (``--vocab
    1000000000``: 256 GB); it is now a flag error naming the model's flags. The failure is
    simulated: a real one could wake the OOM killer where memory is overcommitted."""
    from dynctx.models import random_models

    def too_large(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "256000000000 bytes")

    monkeypatch.setattr(random_models, "random_causal_lm", too_large)
    with pytest.raises(SystemExit) as exit_info:
        cli_demo.main(["--vocab", "1000000000", "--plot", ""], prog="dynctx demo")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert ("dynctx demo: error: the random model of --vocab 1000000000, --hidden 64, --layers "
            "2, --intermediate 128 does not fit in memory on cpu: lower them") in err


def test_the_kernel_backend_from_the_environment_is_named(plain_env, monkeypatch, capsys):
    monkeypatch.setenv("DYNCTX_KERNEL_BACKEND", "triton")
    with pytest.raises(SystemExit):
        cli_demo.main([])
    assert "$DYNCTX_KERNEL_BACKEND triton on device cpu" in capsys.readouterr().err
    monkeypatch.setenv("DYNCTX_KERNEL_BACKEND", "cuda")
    with pytest.raises(SystemExit):
        cli_demo.main([])
    assert "DYNCTX_KERNEL_BACKEND='cuda' is not a kernel backend" in capsys.readouterr().err


def test_a_bad_demo_flag_from_the_shell():
    result = subprocess.run([sys.executable, "-P", "-m", "dynctx", "demo", "--requests", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("python -m dynctx demo: error: argument --requests: 0 is not an "
                             "integer >= 1 (see 'python -m dynctx demo --help')\n")


def test_the_demo_sizes_its_buffer_in_the_blocks_it_prints():
    from dynctx.models.random_models import kv_block_bytes, random_causal_lm

    parser = cli_demo.build_parser()
    args = parser.parse_args([])
    block_bytes = kv_block_bytes(random_causal_lm("llama"), args.block_size)
    sizing = demo_run.kv_sizing(args, block_bytes)
    assert (sizing.blocks, sizing.paused_blocks, sizing.active_blocks) == (13, 3, 10)
    assert "(default: 13)" in _help(parser)
    gb = parser.parse_args(["--buffer-size-gb", str(sizing.buffer_gb),
                            "--paused-buffer-size-gb", str(sizing.paused_gb)])
    from_gb = demo_run.kv_sizing(gb, block_bytes)
    assert (from_gb.blocks, from_gb.paused_blocks) == (13, 3)
    assert cli_demo.check_args(args) is None and demo_run.buffer_problem(args, sizing) is None


@pytest.mark.parametrize("argv0,name", [("/usr/local/bin/dynctx", "dynctx"),
                                        ("dynctx", "dynctx"),
                                        (r"C:\\venv\\Scripts\\dynctx.exe", "python -m dynctx"),
                                        ("/x/site-packages/dynctx/__main__.py", "python -m dynctx"),
                                        ("", "python -m dynctx")])
def test_program_name(argv0, name):
    assert _cli_common.program_name(argv0) == name


def test_console_script_usage_names_dynctx():
    script = Path(sys.executable).with_name("dynctx")
    if not script.exists():
        pytest.skip(f"no dynctx console script next to {sys.executable} (not pip-installed)")
    for args in (["--help"], ["demo", "--help"]):  # (neither imports torch: fast)
        result = subprocess.run([str(script), *args], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: dynctx"), result.stdout[:200]
        assert "python -m dynctx" not in result.stdout


def test_python_m_usage_names_python_m(capsys):
    assert cli_main.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m dynctx")
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["demo", "--help"], prog="dynctx")
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: dynctx demo")


@pytest.mark.parametrize("argv", [["tune"], ["--bogus"]])
def test_unknown_command_names_the_choices(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "autotune, demo" in err and argv[0] in err and err.count("\n") == 1


def _block_rows(out: str, kernel: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if f"  {kernel}  (" in line)
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_show_is_narrow_and_sorts_numbers_as_numbers(capsys):
    assert cli_autotune.main(["show", "--device", "NVIDIA_H200"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120
    rows = _block_rows(out, "kv_append")
    assert rows[0][:2] == ["all", "keys:"]
    header = rows[1]
    tokens = [int(row[header.index("num_tokens")]) for row in rows[2:]]
    assert len(tokens) >= 3 and tokens == sorted(tokens)


def test_show_under_a_closed_pipe_ends_quietly():
    # The reader goes away before the command writes anything: every write hits EPIPE.
    proc = subprocess.Popen([sys.executable, "-m", "dynctx", "autotune", "show"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    assert proc.returncode == 1


def test_demo_without_transformers_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    assert cli_demo.main(["--no-progress", "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert "pip install 'dynctx[demo]'" in err and "transformers" in err


def test_demo_progress_bars_end_at_100_percent_before_the_summary(capsys, monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # capsys' stderr, as a terminal
    assert cli_demo.main(["--requests", "3", "--max-new-tokens", "4", "--plot", ""]) == 0
    captured = capsys.readouterr()
    bars = captured.err.replace("\r", "\n")
    generating = [line for line in bars.splitlines() if line.startswith("generating")]
    checking = [line for line in bars.splitlines() if line.startswith("checking against")]
    assert generating and "100%" in generating[-1]
    assert checking and "100%" in checking[-1] and "3/3" in checking[-1]
    assert captured.err.endswith("\n")  # the summary starts on a fresh line, also in a log
    assert "check             OK: 3/3" in captured.out


def test_demo_progress_bars_stay_out_of_a_log(capsys):
    """stderr is not a terminal (capsys, a file, a pipe): no bar, not even one update."""
    assert not sys.stderr.isatty()
    assert cli_demo.main(["--requests", "3", "--max-new-tokens", "4", "--plot", ""]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "check             OK: 3/3" in captured.out


def _history(steps: int) -> list[demo_plot.StepRecord]:
    return [demo_plot.StepRecord(step=i, active=i % 150, paused=(i // 7) % 5,
                                evictions=int(i % 997 == 0), kv_utilization=(i % 100) / 100)
            for i in range(steps)]


def test_aggregate_keeps_short_runs_and_windows_long_ones():
    short = demo_plot.aggregate(_history(300))
    assert short["width"] == 1 and len(short["step"]) == 300
    assert short["active_mean"].tolist() == [float(i % 150) for i in range(300)]

    long = demo_plot.aggregate(_history(4000))
    assert long["width"] == 10 and len(long["step"]) == 400
    assert long["step"][:3].tolist() == [0, 10, 20]
    assert long["active_mean"][0] == pytest.approx(4.5)  # mean of 0..9
    assert (long["active_min"][0], long["active_max"][0]) == (0, 9)
    assert long["evictions"].sum() == sum(1 for i in range(4000) if i % 997 == 0)
    assert long["kv_percent"][0] == pytest.approx(4.5)


def test_plot_of_150_requests_over_4000_steps(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "long.png"
    demo_plot.plot_history(_history(4000), str(path), "long run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
