"""The command line as a user meets it: plain help with defaults, the program's own name,
``autotune show`` readable and quiet under ``| head``, the demo's missing-extra message, its
progress bars and its plot of long runs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynctx import __main__ as cli_main
from dynctx import _cli_common, cli_autotune, cli_demo


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


def test_unknown_command_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        cli_main.main(["tune"])
    assert "demo" in capsys.readouterr().err


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


def test_demo_progress_bars_end_at_100_percent_before_the_summary(capsys):
    pytest.importorskip("tqdm")
    assert cli_demo.main(["--requests", "3", "--max-new-tokens", "4", "--plot", ""]) == 0
    captured = capsys.readouterr()
    bars = captured.err.replace("\r", "\n")
    generating = [line for line in bars.splitlines() if line.startswith("generating")]
    checking = [line for line in bars.splitlines() if line.startswith("checking against")]
    assert generating and "100%" in generating[-1]
    assert checking and "100%" in checking[-1] and "3/3" in checking[-1]
    assert captured.err.endswith("\n")  # the summary starts on a fresh line, also in a log
    assert "check             OK: 3/3" in captured.out


def _history(steps: int) -> list[cli_demo.StepRecord]:
    return [cli_demo.StepRecord(step=i, active=i % 150, paused=(i // 7) % 5,
                                evictions=int(i % 997 == 0), kv_utilization=(i % 100) / 100)
            for i in range(steps)]


def test_aggregate_keeps_short_runs_and_windows_long_ones():
    short = cli_demo.aggregate(_history(300))
    assert short["width"] == 1 and len(short["step"]) == 300
    assert short["active_mean"].tolist() == [float(i % 150) for i in range(300)]

    long = cli_demo.aggregate(_history(4000))
    assert long["width"] == 10 and len(long["step"]) == 400
    assert long["step"][:3].tolist() == [0, 10, 20]
    assert long["active_mean"][0] == pytest.approx(4.5)  # mean of 0..9
    assert (long["active_min"][0], long["active_max"][0]) == (0, 9)
    assert long["evictions"].sum() == sum(1 for i in range(4000) if i % 997 == 0)
    assert long["kv_percent"][0] == pytest.approx(4.5)


def test_plot_of_150_requests_over_4000_steps(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "long.png"
    cli_demo.plot_history(_history(4000), str(path), "long run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
