"""The 0.19 port's own machinery: the ``Gap`` placeholders, the mode's names, and the runner's
source detection and result counting (``mcore019_port.py``, ``run_port.py``)."""

from __future__ import annotations

import textwrap

import mcore019_port
import pytest
import run_port
from mcore019_port import GAPS, MODE, DynctxGap, Gap


def test_a_gap_raises_naming_the_name_and_its_0_19_location():
    gap = Gap("KVBlockAllocator", "megatron/core/inference/contexts/kv_block_allocator.py")
    pattern = r"dynctx has no KVBlockAllocator yet \(Megatron-Core 0.19: megatron/core/.*\)"
    with pytest.raises(DynctxGap, match=pattern):
        gap(object(), total_count=4, paused_count=1)
    with pytest.raises(DynctxGap, match=pattern):
        gap.reset()
    with pytest.raises(DynctxGap):
        3 * gap
    assert isinstance(DynctxGap("x"), NotImplementedError)
    assert repr(gap) == "Gap('KVBlockAllocator')"


@pytest.mark.skipif(MODE != "dynctx", reason="the gaps are dynctx's")
def test_every_listed_gap_is_still_missing_from_dynctx():
    # When dynctx gains one of these names the port uses it, and its GAPS entry goes.
    import dynctx.context as dc

    assert [name for name in GAPS if hasattr(dc, name)] == []
    assert all(isinstance(getattr(mcore019_port, name), Gap) for name in GAPS)


def test_the_names_come_from_the_modes_implementation():
    module = mcore019_port.DynamicInferenceContext.__module__
    expected = "megatron.core.inference." if MODE == "megatron019" else "dynctx.context."
    assert module.startswith(expected)
    assert mcore019_port.context_class() is mcore019_port.DynamicInferenceContext


def test_the_runner_refuses_a_folder_that_is_no_checkout(tmp_path):
    with pytest.raises(SystemExit, match="neither a tree with megatron/core nor a git checkout"):
        run_port.source_tree(tmp_path, "core_v0.19.0", tmp_path / "out")
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\n")
    assert run_port.source_tree(tmp_path, "core_v0.19.0", tmp_path / "out") == tmp_path


def test_the_runner_counts_per_file_and_groups_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(textwrap.dedent("""\
        <testsuites><testsuite>
          <testcase file="tests/megatron019/test_a.py" name="t1"/>
          <testcase file="tests/megatron019/test_a.py" name="t2">
            <failure message="TypeError: got an unexpected keyword argument 'model_config'"/>
          </testcase>
          <testcase file="tests/megatron019/test_b.py" name="t3">
            <error message="TypeError: got an unexpected keyword argument 'model_config'&#10;x"/>
          </testcase>
          <testcase file="tests/megatron019/test_b.py" name="t4"><skipped message="s"/></testcase>
        </testsuite></testsuites>"""))
    per_file, first_lines = run_port.read_results(xml)
    assert dict(per_file["test_a.py"]) == {"passed": 1, "failed": 1}
    assert dict(per_file["test_b.py"]) == {"failed": 1, "skipped": 1}
    assert first_lines == {"TypeError: got an unexpected keyword argument 'model_config'": 2}
    text = run_port.table({"dynctx": per_file})
    assert "test_a.py  1/1/0" in text and "test_b.py  0/1/1" in text
