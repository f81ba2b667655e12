"""Every committed ``autotune_cache/<device>/<kernel>.json``: valid, canonical, inside the
kernel's current search space, found by the lookup, and correct.

The correctness test runs the Triton kernel with each committed config: under the interpreter
(``TRITON_INTERPRET=1``, tests/run_tests.sh) on a scaled-down key, or compiled on a GPU (CUDA
visible and the interpreter off, or ``DYNCTX_TEST_DEVICE=cuda``) at the committed key itself. The
scaled-down key sets the token field to at most 4; a kernel module whose other dimensions are
too large for the interpreter exposes ``scaled_down_key(key) -> dict``, which must keep every
dimension its search space depends on.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from dynctx import cli_autotune as cli
from dynctx.kernels import autotune, registry
from dynctx.kernels.autotune import KernelConfig
from dynctx.kernels.backend import triton_interpreting

# The kernel tests' rule: CUDA when there is one and the interpreter is off; the environment
# variable forces a choice (bench/device_check.sh sets it to cuda).
TEST_DEVICE = os.environ.get("DYNCTX_TEST_DEVICE") or (
    "cuda" if torch.cuda.is_available() and not triton_interpreting() else "cpu")
FILES = sorted(autotune.PACKAGED_DIR.glob("*/*.json"))
NO_FILES = ("no committed autotune configs under autotune_cache/*/ yet: nothing to check "
            "(`python -m dynctx autotune tune` on a GPU writes them)")
PARAMS = [pytest.param(p, id=f"{p.parent.name}/{p.stem}") for p in FILES] or [
    pytest.param(None, id="no-committed-files")]

registry.import_kernel_modules(quiet=True)


def _load(path):
    if path is None:
        pytest.skip(NO_FILES)
    return json.loads(path.read_text(encoding="utf-8"))


def _tuning(data):
    tuning = autotune.registered().get(data["kernel"])
    assert tuning is not None, (f"committed configs for {data['kernel']!r}, which no kernel module "
                                f"registers (known: {sorted(autotune.registered())})")
    return tuning


def scaled_down_key(tuning, key: dict) -> dict:
    """The committed key with its token field at most 4, or the module's own scaled-down key."""
    module = sys.modules[tuning.configs.__module__]
    hook = getattr(module, "scaled_down_key", None)
    if hook is not None:
        return hook(key)
    return {**key, tuning.token_field: min(key[tuning.token_field], 4)}


@pytest.mark.parametrize("path", PARAMS)
def test_file_is_valid_and_canonical(path):
    data = _load(path)
    autotune.validate_cache_data(data, str(path))
    assert data["kernel"] == path.stem
    assert data["device"] == path.parent.name
    text = path.read_text(encoding="utf-8")
    ordered = sorted(data["entries"], key=lambda e: json.dumps(e["key"], sort_keys=True))
    assert text == autotune.canonical_json({**data, "entries": ordered}), (
        f"{path} is not canonical: rewrite it with autotune.write_cache_file")
    assert {"torch", "triton", "git_revision"} <= set(data["versions"])


@pytest.mark.parametrize("path", PARAMS)
def test_configs_are_inside_the_search_space(path):
    data = _load(path)
    tuning = _tuning(data)
    fields = cli._key_fields(tuning)
    for entry in data["entries"]:
        key, config = entry["key"], KernelConfig.from_dict(entry["config"])
        if fields is not None:
            assert set(key) == fields, (
                f"{path}: key {key} has not the fields of {tuning.name}'s keys")
        tokens = key[tuning.token_field]
        assert autotune.bucket_tokens(tokens) == tokens, f"{path}: raw token count in key {key}"
        assert config in tuning.configs(key), (
            f"{path}: committed config {config} for {key} is outside {tuning.name}'s search space; "
            "re-tune it (python -m dynctx autotune tune) or widen the search space")
        assert str(config) in entry["times_us"], f"{path}: {config} for {key} was not timed"
    assert cli.check_file(path) == []


@pytest.mark.parametrize("path", PARAMS)
def test_lookup_returns_the_committed_config(path, tmp_path, monkeypatch):
    """Served through the override folder, every committed key resolves to its config."""
    data = _load(path)
    tuning = _tuning(data)
    device = autotune.device_name("cpu")
    target = tmp_path / device / path.name
    target.parent.mkdir(parents=True)
    shutil.copy(path, target)
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path))
    monkeypatch.setattr(autotune, "PACKAGED_DIR", tmp_path / "nothing-packaged")
    for entry in data["entries"]:
        config, source = autotune.resolve_config(tuning.name, entry["key"], "cpu")
        assert config == KernelConfig.from_dict(entry["config"])
        assert source == f"override-exact:{target}"


@pytest.mark.interpreter
@pytest.mark.gpu
@pytest.mark.parametrize("path", PARAMS)
def test_committed_configs_match_the_reference(path):
    data = _load(path)
    if TEST_DEVICE == "cpu" and not triton_interpreting():
        pytest.skip("launches Triton kernels: needs TRITON_INTERPRET=1 (tests/run_tests.sh) or a "
                    "CUDA device")
    if TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"DYNCTX_TEST_DEVICE={TEST_DEVICE} but no CUDA device is visible")
    tuning = _tuning(data)
    assert tuning.make_case is not None, f"{tuning.name} declares no make_case"
    device = torch.device(TEST_DEVICE)
    for entry in data["entries"]:
        config = KernelConfig.from_dict(entry["config"])
        key = entry["key"] if device.type == "cuda" else scaled_down_key(tuning, entry["key"])
        assert config in tuning.configs(key), (
            f"{tuning.name}: {config} is in the space of {entry['key']} but not of the scaled-down "
            f"key {key}; give kernels/{registry.module_of(tuning)}.py a scaled_down_key(key) "
            "that keeps the dimensions its search space depends on")
        tuning.make_case(key, device).check(config)
