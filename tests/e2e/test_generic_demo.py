"""``python -m dynctx demo --model NAME`` runs every family it names and checks it against
transformers (the dedicated Llama and DeepSeek-V3 adapters, the generic path for the rest)."""

from __future__ import annotations

import pytest

from dynctx import cli_demo
from dynctx.models.random_models import RANDOM_MODELS

DEDICATED = ("llama", "deepseek_v3")


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_demo_runs_every_family(name, capsys):
    assert cli_demo.main(["--model", name, "--requests", "4", "--max-new-tokens", "6",
                          "--plot", "", "--no-progress"]) == 0
    out = capsys.readouterr().out
    path = "dedicated" if name in DEDICATED else "generic"
    assert f"({path} path;" in out
    assert "check             OK: 4/4 outputs match" in out
