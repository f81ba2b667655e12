"""``python -m dynctx demo``: runs, reports, plots, and fails on a mismatch."""

from __future__ import annotations

import re
import subprocess
import sys

from dynctx import cli_demo


def summary_count(text: str, label: str) -> int:
    return int(re.search(rf"^{label}\s+(\d+)", text, re.M).group(1))


def test_demo_runs_and_matches_transformers(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    assert cli_demo.main(["--plot", str(plot), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "check             OK: 24/24 outputs match" in out
    assert summary_count(out, "pauses") > 0
    assert summary_count(out, "evictions") > 0
    assert summary_count(out, "chunked prefills") > 0
    assert "torch paged attention" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_exit_code_on_mismatch(tmp_path, capsys, monkeypatch):
    import dynctx.engine.step as step_module

    real_sample = step_module.sample_checked

    def off_by_one(logits, params, token_indices, generator):
        tokens, _ = real_sample(logits, params, token_indices, generator)
        tokens = (tokens + 1) % logits.shape[-1]
        return tokens, tokens

    monkeypatch.setattr(step_module, "sample_checked", off_by_one)
    code = cli_demo.main(["--requests", "4", "--max-new-tokens", "4", "--plot", "",
                          "--no-progress"])
    assert code == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_python_m_dynctx_demo_help():
    result = subprocess.run([sys.executable, "-m", "dynctx", "demo", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert "--buffer-blocks" in result.stdout and "--block-size" in result.stdout


def test_demo_with_prefix_caching_shows_the_hit_rate_and_matches(capsys):
    assert cli_demo.main(["--requests", "8", "--max-new-tokens", "8", "--shared-prefix", "20",
                          "--prefix-caching", "lru", "--plot", "", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "check             OK: 8/8 outputs match" in out
    hits = re.search(r"^prefix cache\s+lru: (\d+) hits of (\d+) new adds \((\d+)%;", out, re.M)
    assert hits and int(hits.group(1)) > 0, out
