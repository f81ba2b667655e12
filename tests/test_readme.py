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


MAKEFILE = README.with_name("Makefile")


def make_rules() -> dict[str, tuple[str, list[str]]]:
    """``target -> (prerequisites, recipe lines)`` of the Makefile's rules."""
    rules: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in MAKEFILE.read_text().splitlines():
        rule = re.match(r"^([^\s:#=]+):(?!=)(.*)$", line)
        if rule:
            current = rule.group(1)
            rules[current] = (rule.group(2).strip(), [])
        elif line.startswith("\t") and current is not None:
            rules[current][1].append(line.strip())
        elif line.strip() and not line.startswith("#"):
            current = None
    return rules


def test_every_make_target_the_readme_names_is_phony_and_does_something():
    """``make test-fast`` was once listed in .PHONY with no rule: every .PHONY target has a
    recipe or prerequisites, and every ``make X`` of the README is one of them."""
    rules = make_rules()
    phony = rules.pop(".PHONY")[0].split()
    assert [name for name in phony if not any(rules.get(name, ("", [])))] == []
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README.read_text()))
    assert {"demo", "test", "test-fast"} <= named
    assert named <= set(phony), f"README.md names make targets {named - set(phony)}"


def test_the_commands_the_readme_names_parse():
    """Every ``python -m dynctx demo ...`` of the README is a flag set the demo accepts, and
    ``autotune tune|show|check|bench`` lists the autotune commands there are."""
    from dynctx import cli_autotune, cli_demo

    text = README.read_text()
    demos = re.findall(r"python -m dynctx demo((?: --?[\w-]+(?: [^\s`-][^\s`]*)?)*)", text)
    assert len(demos) >= 2 and any(demos)
    for flags in demos:
        cli_demo.build_parser().parse_args(flags.split())  # SystemExit(2) on an unknown flag
    listed = re.search(r"python -m dynctx autotune ([\w|]+)", text).group(1).split("|")
    parser = cli_autotune.build_parser()
    commands = next(action.choices for action in parser._actions
                    if hasattr(action, "choices") and isinstance(action.choices, dict))
    assert listed == list(commands)
