"""``python -m dynctx demo``: runs, reports, plots, and fails on a mismatch; its context has the
blocks its flags (and their defaults in ``--help``) ask for."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dynctx import cli_demo


def summary_count(text: str, label: str) -> int:
    return int(re.search(rf"^{label}\s+(\d+)", text, re.M).group(1))


def test_demo_runs_and_matches_transformers(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    assert cli_demo.main(["--plot", str(plot), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "check             OK: 24/24 outputs match" in out
    # --help: --buffer-blocks (default: 13), --paused-blocks (default: 3)
    assert "context: 13 KV blocks of 16 tokens (active budget 10, paused budget 3)" in out
    assert summary_count(out, "pauses") > 0
    assert summary_count(out, "evictions") > 0
    assert summary_count(out, "chunked prefills") > 0
    assert "torch paged attention" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags, blocks", [
    (["--buffer-blocks", "9", "--paused-blocks", "2"], "9 KV blocks of 16 tokens (active budget "
                                                       "7, paused budget 2)"),
    (["--buffer-size-gb", "1e-4"], "12 KV blocks of 16 tokens (active budget 9, paused budget "
                                   "3)"),  # 13 blocks of 8 KiB fit, one is the padding block
], ids=["blocks", "gib"])
def test_the_context_has_the_blocks_the_flags_ask_for(capsys, flags, blocks):
    assert cli_demo.main(["--requests", "2", "--max-new-tokens", "2", "--plot", "",
                          "--no-progress", *flags]) == 0
    out = capsys.readouterr().out
    assert f"context: {blocks}" in out and "check             OK: 2/2" in out


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
