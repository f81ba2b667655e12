"""The README's Python blocks run as written.

Every ```python block of README.md is executed, in order, in one namespace (later blocks use
what earlier ones defined, as a reader would). A block that is deliberately a fragment must be
preceded by the line ``<!-- readme-test: skip (the reason) -->``; there is none today, and the
test fails if a skipped block gives no reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!-- readme-test: skip(.*?)-->\s*$")


def python_blocks() -> list[tuple[int, str, str | None]]:
    """``(line number, code, skip reason or None)`` of every Python block."""
    text = README.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        blocks.append((line, match.group(1), skip.group(1).strip(" ()") if skip else None))
    return blocks


def test_readme_has_the_usage_and_engine_blocks():
    codes = [code for _, code, _ in python_blocks()]
    assert len(codes) >= 3
    assert any("ctx.update_requests(mask, new_tokens)" in code for code in codes)
    assert any("engine.generate(prompts" in code for code in codes)
    assert any("engine.generate_requests(requests" in code for code in codes)


def test_readme_names_every_engine_stats_field():
    from dataclasses import fields

    from dynctx.engine import EngineStats

    text = README.read_text()
    missing = [f.name for f in fields(EngineStats) if f"stats.{f.name}" not in text]
    assert not missing, f"README.md does not name engine.stats fields {missing}"


def test_skipped_blocks_say_why():
    for line, _, reason in python_blocks():
        assert reason is None or reason, f"README.md:{line}: a skipped block must give a reason"


def test_readme_python_blocks_run(monkeypatch, tmp_path):
    pytest.importorskip("transformers", reason="the engine blocks need the test extra")
    monkeypatch.chdir(tmp_path)  # anything a block writes lands here
    namespace: dict = {"__name__": "readme"}
    ran = 0
    for line, code, reason in python_blocks():
        if reason is not None:
            continue
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
        ran += 1
    assert ran == len(python_blocks())
    # What the blocks promise.
    assert namespace["generated"] and len(namespace["generated"]) == 4
    assert namespace["ctx"].total_request_count == 0
    outputs, prompts = namespace["outputs"], namespace["prompts"]
    assert len(outputs) == len(prompts) and all(1 <= len(out) <= 8 for out in outputs)
    results = namespace["results"]
    assert [r.request_id for r in results] == list(range(len(prompts)))
    assert all(r.finish_reason in ("stop", "length") for r in results)
