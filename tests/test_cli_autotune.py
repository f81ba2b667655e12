"""``python -m dynctx autotune``: refusals without a GPU, ``show`` and ``check`` on empty and
temporary caches, the folders they read and write (a missing ``--dir`` or
``$DYNCTX_AUTOTUNE_DIR`` is an error; ``tune`` writes to the folder launchers read first;
``bench`` writes only to ``--out``), the tune/bench bookkeeping driven by a toy kernel with a
fake clock, and the Megatron-Core peer that ``bench`` loads from the package.

Nothing here launches a Triton kernel or needs CUDA. The fake-GPU tests replace the device, the
timer and the device name, so they check what ``tune`` and ``bench`` write, not what they time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dynctx import autotune_runs, megatron_peer
from dynctx import cli_autotune as cli
from dynctx.kernels import autotune, timing
from dynctx.kernels.autotune import KernelConfig, KernelTuning, TuneCase
from dynctx.kernels.registry import (
    PRESET_MODULES,
    import_kernel_modules,
    module_of,
    select_tunings,
)

TOY = "toy_cli_test_only_kernel"
FAKE_DEVICE = "FAKE_GPU"
SPACE = [KernelConfig.make(BLOCK=b, num_warps=w) for b in (16, 32, 64) for w in (4, 8)]
BROKEN = KernelConfig.make(BLOCK=64, num_warps=8)  # the toy's check rejects this one


def toy_key(num_tokens: int, width: int = 8) -> dict:
    return {"num_tokens": autotune.bucket_tokens(num_tokens), "width": width, "dtype": "float32"}


class ToyCase(TuneCase):
    """Pure torch: ``run`` adds one, ``check`` compares with the reference."""

    def __init__(self, key: dict, device: torch.device):
        self.x = torch.zeros(key["num_tokens"], key["width"], device=device)
        self.bytes_moved = 2 * self.x.numel() * self.x.element_size()
        self.last_config = None

    def run(self, config: KernelConfig) -> None:
        self.last_config = config
        self.x.add_(1 if config != BROKEN else 2)

    def run_reference(self) -> None:
        self.last_config = None
        self.x.add_(1)

    def check(self, config: KernelConfig) -> None:
        before = self.x.clone()
        self.run(config)
        assert torch.equal(self.x, before + 1), f"{config} differs from the reference"


def fake_us(config: KernelConfig | None) -> float:
    """A deterministic stand-in for a measurement: BLOCK=32,w4 is the fastest."""
    if config is None:
        return 40.0
    meta = config.kwargs
    return 10.0 + abs(meta["BLOCK"] - 32) / 8 + (config.num_warps - 4) / 4


@pytest.fixture
def toy(monkeypatch, tmp_path):
    tuning = KernelTuning(name=TOY, configs=lambda key: list(SPACE),
                          default_config=lambda key: SPACE[0],
                          tune_key=lambda **shapes: toy_key(**shapes),
                          make_case=lambda key, device: ToyCase(key, device),
                          presets=lambda: [toy_key(1), toy_key(64)])
    monkeypatch.setitem(autotune._TUNINGS, TOY, tuning)
    monkeypatch.setattr(autotune, "_WARNED", set())
    monkeypatch.setattr(autotune, "PACKAGED_DIR", tmp_path / "packaged")
    monkeypatch.delenv(autotune.OVERRIDE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user_cache"))
    return tuning


@pytest.fixture
def fake_gpu(monkeypatch, toy):
    """Lets tune and bench run on the CPU with the toy kernel and a fake clock."""
    cases = []
    real_make_case = toy.make_case

    def make_case(key, device):
        cases.append(real_make_case(key, device))
        return cases[-1]

    monkeypatch.setitem(autotune._TUNINGS, TOY, KernelTuning(
        name=TOY, configs=toy.configs, default_config=toy.default_config, tune_key=toy.tune_key,
        make_case=make_case, presets=toy.presets))

    def fake_time(fn, **kwargs):
        """Runs ``fn`` once and "times" it by what it did: the kernel, the reference or a copy."""
        case = cases[-1]
        case.last_config = untouched = object()
        fn()
        if case.last_config is untouched:
            us = 5.0  # the device-to-device copy
        else:
            us = fake_us(case.last_config)
        return {"us": us, "method": "fake", "launches": 1, "replays": 1}

    monkeypatch.setattr(autotune_runs, "refuse_without_gpu", lambda command: False)
    monkeypatch.setattr(autotune_runs, "gpu_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(timing, "time_launches", fake_time)
    monkeypatch.setattr(autotune_runs, "cuda_alive", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(autotune, "device_name", lambda device=None: FAKE_DEVICE)
    monkeypatch.setenv("DYNCTX_GIT_REVISION", "test-revision")
    return cases


def write_toy_file(root, entries, device="cpu"):
    path = root / device / f"{TOY}.json"
    autotune.write_cache_file(path, device=device, kernel=TOY, entries=entries,
                               versions={"torch": "test"})
    return path


def toy_entry(key, config=SPACE[2], times=None):
    return {"key": key, "config": config.to_dict(), "times_us": times or {str(config): 3.5}}


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_gpu_commands_refuse_without_a_gpu(monkeypatch, capsys, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert f"autotune {command}: refused" in err and "CUDA GPU" in err


def test_gpu_commands_refuse_under_the_interpreter(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.main(["tune", "--kernel", "kv_append"]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


def test_python_dash_m_refuses_tune_without_a_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "dynctx", "autotune", "tune", "--preset", "llama"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refused" in proc.stderr and "CUDA GPU" in proc.stderr


def test_show_and_check_with_an_empty_cache(toy, capsys):
    assert cli.main(["show"]) == 0
    assert "no committed configs" in capsys.readouterr().out
    assert cli.main(["check"]) == 0
    assert "0 files" in capsys.readouterr().out


def _one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["check", "show"])
def test_a_missing_dir_is_an_error(toy, tmp_path, capsys, command):
    err = _one_line_error(capsys, [command, "--dir", str(tmp_path / "nonexistent")])
    assert err.startswith(f"python -m dynctx autotune {command}: error: ")
    assert err.rstrip().endswith(f"(see 'python -m dynctx autotune {command} --help')")
    assert f"--dir {tmp_path / 'nonexistent'}: does not exist" in err
    (tmp_path / "a_file").write_text("")
    err = _one_line_error(capsys, [command, "--dir", str(tmp_path / "a_file")])
    assert "is not a folder" in err


def test_check_of_a_folder_without_config_files_is_an_error(toy, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = _one_line_error(capsys, ["check", "--dir", str(tmp_path / "empty")])
    assert "no <device>/<kernel>.json files under it" in err
    path = write_toy_file(tmp_path / "root", [toy_entry(toy_key(8))])
    err = _one_line_error(capsys, ["check", "--dir", str(path.parent)])  # the device folder
    assert f"it holds {TOY}.json directly: pass its parent folder" in err
    assert cli.main(["check", "--dir", str(tmp_path / "root")]) == 0


@pytest.mark.parametrize("command", [["show"], ["check"], ["bench"]])
def test_a_wrong_override_folder_is_an_error(toy, tmp_path, monkeypatch, capsys, command):
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path / "typo"))
    monkeypatch.setattr(autotune_runs, "refuse_without_gpu", lambda command: False)
    err = _one_line_error(capsys, command)
    assert f"$DYNCTX_AUTOTUNE_DIR={tmp_path / 'typo'} does not exist" in err


def test_a_wrong_override_folder_fails_the_lookup_at_run_time(toy, tmp_path, monkeypatch):
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path / "typo"))
    with pytest.raises(ValueError, match=r"\$DYNCTX_AUTOTUNE_DIR=.*typo does not exist: point "
                                         "it at a folder laid out like autotune_cache/"):
        autotune.resolve_config(TOY, toy_key(8), "cpu")
    monkeypatch.setenv(autotune.OVERRIDE_ENV, "")  # empty: unset
    assert autotune.resolve_config(TOY, toy_key(8), "cpu") == (SPACE[0], "default")


def test_the_per_user_folder_is_read_when_no_override_is_set(toy, tmp_path, monkeypatch):
    user = autotune.user_cache_dir()
    assert user == tmp_path / "user_cache" / "dynctx" / "autotune_cache"
    assert autotune.resolve_config(TOY, toy_key(8), "cpu") == (SPACE[0], "default")
    path = write_toy_file(user, [toy_entry(toy_key(8))])
    assert autotune.resolve_config(TOY, toy_key(8), "cpu") == (
        SPACE[2], f"override-exact:{path}")
    # Another user folder is another lookup (resolved configs are cached per folder).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other_cache"))
    assert autotune.resolve_config(TOY, toy_key(8), "cpu") == (SPACE[0], "default")


def test_tune_writes_to_the_folder_launchers_read_first(fake_gpu, tmp_path, monkeypatch,
                                                        capsys):
    assert cli.main(["tune", "--kernel", TOY]) == 0
    user = autotune.user_cache_dir()
    out = capsys.readouterr().out
    assert f"-> {user / FAKE_DEVICE} (the per-user folder launchers read first" in out
    assert f"wrote 2 entries under {user / FAKE_DEVICE}" in out
    assert (user / FAKE_DEVICE / f"{TOY}.json").is_file()
    assert not (tmp_path / "packaged").exists()
    assert autotune.resolve_config(TOY, toy_key(1), FAKE_DEVICE)[1].startswith("override-exact")

    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path / "named"))
    assert cli.main(["tune", "--kernel", TOY]) == 0
    assert f"(${autotune.OVERRIDE_ENV}, which launchers read first)" in capsys.readouterr().out
    assert (tmp_path / "named" / FAKE_DEVICE / f"{TOY}.json").is_file()


def test_show_lists_an_override_file(toy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path / "override"))
    write_toy_file(tmp_path / "override", [toy_entry(toy_key(8))])
    assert cli.main(["show"]) == 0
    out = capsys.readouterr().out
    assert TOY in out and "num_tokens=8" in out and str(SPACE[2]) in out and "override" in out
    assert cli.main(["show", "--device", "NVIDIA_NONE"]) == 0
    assert "no committed configs for device NVIDIA_NONE" in capsys.readouterr().out


def test_check_accepts_a_good_override_file(toy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path / "override"))
    write_toy_file(tmp_path / "override", [toy_entry(toy_key(8)), toy_entry(toy_key(1), SPACE[0])])
    assert cli.main(["check"]) == 0, capsys.readouterr().out
    assert "1 files" in capsys.readouterr().out


@pytest.mark.parametrize("damage, message", [
    pytest.param(lambda e: e.update(config=KernelConfig.make(BLOCK=128).to_dict(),
                                    times_us={"BLOCK=128,w4,s1": 1.0}),
                 "outside the current search space", id="stale-config"),
    pytest.param(lambda e: e.update(key={**e["key"], "extra": 1}), "key fields", id="extra-field"),
    pytest.param(lambda e: e.update(key={**e["key"], "num_tokens": 6}), "power-of-two",
                 id="raw-token-count"),
    pytest.param(lambda e: e.update(times_us={"something-else": 1.0}), "no measured time",
                 id="chosen-config-not-timed"),
])
def test_check_reports_problems(toy, tmp_path, capsys, damage, message):
    entry = toy_entry(toy_key(8))
    damage(entry)
    write_toy_file(tmp_path / "scratch", [entry])
    assert cli.main(["check", "--dir", str(tmp_path / "scratch")]) == 1
    out = capsys.readouterr().out
    assert message in out and "1 problems" in out


def test_check_reports_non_canonical_text_and_bad_names(toy, tmp_path, capsys):
    path = write_toy_file(tmp_path / "scratch", [toy_entry(toy_key(8))])
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data))  # one line, no final newline
    wrong_folder = tmp_path / "scratch" / "other_device" / f"{TOY}.json"
    wrong_folder.parent.mkdir()
    wrong_folder.write_text(autotune.canonical_json(data))
    assert cli.main(["check", "--dir", str(tmp_path / "scratch")]) == 1
    out = capsys.readouterr().out
    assert "not canonical" in out and "does not match the folder name" in out


def test_check_reports_a_malformed_file_and_an_unknown_kernel(toy, tmp_path, capsys):
    root = tmp_path / "scratch"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / f"{TOY}.json").write_text("{oops")
    autotune.write_cache_file(root / "cpu" / "no_such_kernel.json", device="cpu",
                               kernel="no_such_kernel", entries=[toy_entry(toy_key(1))],
                               versions={})
    assert cli.main(["check", "--dir", str(root)]) == 1
    out = capsys.readouterr().out
    assert "not valid JSON" in out and "no registered kernel named 'no_such_kernel'" in out


def test_tune_writes_the_fastest_passing_config(fake_gpu, tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert cli.main(["tune", "--kernel", TOY, "--out", str(out_dir)]) == 0
    path = out_dir / FAKE_DEVICE / f"{TOY}.json"
    text = path.read_text()
    data = json.loads(text)
    assert text == autotune.canonical_json(data)
    assert [e["key"] for e in data["entries"]] == [toy_key(1), toy_key(64)]
    for entry in data["entries"]:
        assert KernelConfig.from_dict(entry["config"]) == KernelConfig.make(BLOCK=32, num_warps=4)
        assert set(entry["times_us"]) == {str(c) for c in SPACE if c != BROKEN}
        assert entry["times_us"][str(SPACE[0])] == fake_us(SPACE[0])
        assert list(entry["rejected"]) == [str(BROKEN)]
        assert entry["rejected"][str(BROKEN)].startswith("check: AssertionError")
        assert entry["versions"]["git_revision"] == "test-revision"
    assert data["versions"]["git_revision"] == "test-revision"
    assert set(data["versions"]) >= {"torch", "triton", "cuda", "git_revision"}
    assert cli.check_file(path) == []
    assert f"rejected {BROKEN}" in capsys.readouterr().out


def test_tune_merges_with_entries_of_other_keys_and_skips_existing(fake_gpu, tmp_path, capsys):
    out_dir = tmp_path / "out"
    other = toy_entry(toy_key(8), SPACE[1], {str(SPACE[1]): 2.0})
    kept = toy_entry(toy_key(64), SPACE[3], {str(SPACE[3]): 1.0})
    write_toy_file(out_dir, [other, kept], device=FAKE_DEVICE)
    assert cli.main(["tune", "--kernel", TOY, "--out", str(out_dir), "--skip-existing"]) == 0
    data = json.loads((out_dir / FAKE_DEVICE / f"{TOY}.json").read_text())
    by_tokens = {e["key"]["num_tokens"]: e for e in data["entries"]}
    assert sorted(by_tokens) == [1, 8, 64]
    assert by_tokens[8] == other and by_tokens[64] == kept
    assert "already in" in capsys.readouterr().out
    assert cli.main(["tune", "--kernel", TOY, "--out", str(out_dir)]) == 0
    data = json.loads((out_dir / FAKE_DEVICE / f"{TOY}.json").read_text())
    by_tokens = {e["key"]["num_tokens"]: e for e in data["entries"]}
    assert by_tokens[8] == other and by_tokens[64] != kept


def test_tune_stops_at_max_seconds_and_lists_what_it_skipped(fake_gpu, tmp_path, capsys):
    assert cli.main(["tune", "--kernel", TOY, "--out", str(tmp_path / "out"),
                     "--max-seconds", "1e-9"]) == 0
    out = capsys.readouterr().out
    assert f"skipped: {TOY}" in out and "wrote 0 entries" in out
    assert not (tmp_path / "out" / FAKE_DEVICE / f"{TOY}.json").exists()


def test_tune_fails_when_no_config_passes(fake_gpu, monkeypatch, tmp_path, capsys):
    def check(self, config):
        raise RuntimeError("does not compile")

    monkeypatch.setattr(ToyCase, "check", check)
    assert cli.main(["tune", "--kernel", TOY, "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "no config passed" in out and "RuntimeError: does not compile" in out


def test_bench_writes_results_with_ratios(fake_gpu, tmp_path, capsys):
    out = tmp_path / "results.json"
    write_toy_file(tmp_path / "packaged", [toy_entry(toy_key(1), SPACE[2], {str(SPACE[2]): 1.0})],
                   device=FAKE_DEVICE)
    assert cli.main(["bench", "--kernel", TOY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["device"] == FAKE_DEVICE and data["versions"]["git_revision"] == "test-revision"
    first, second = data["results"]
    assert first["config_source"] == "packaged-exact" and first["config"] == str(SPACE[2])
    assert second["config_source"] == "packaged-nearest"
    for row in data["results"]:
        assert row["check"] == "passed"
        assert row["kernel_us"] == fake_us(SPACE[2])
        assert row["reference_us"] == fake_us(None) and row["copy_us"] == 5.0
        assert row["speedup_vs_reference"] == round(fake_us(None) / fake_us(SPACE[2]), 3)
        assert row["bytes_moved"] > 0
        assert row["kernel_gbps"] == round(row["bytes_moved"] / row["kernel_us"] / 1e3, 2)
        assert row["ratio_to_copy"] == round(row["copy_us"] / row["kernel_us"], 4)
    assert "vs torch" in capsys.readouterr().out


def test_bench_without_out_writes_nothing(fake_gpu, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    assert cli.main(["bench", "--kernel", TOY]) == 0
    assert sorted(tmp_path.rglob("*")) == before
    assert "results -> not written (no --out)" in capsys.readouterr().out


@pytest.fixture
def no_megatron(monkeypatch):
    """megatron_peer with an empty cache and no installed megatron-core."""
    monkeypatch.setattr(megatron_peer, "_CACHE", {})
    monkeypatch.setattr(megatron_peer, "_installed_path", lambda: None)
    for name in (megatron_peer.FILE_ENV, megatron_peer.WHEEL_DIR_ENV):
        monkeypatch.delenv(name, raising=False)


FAKE_KERNEL = "def triton_append_key_value_cache(*args):\n    CALLS.append(args)\nCALLS = []\n"


def test_megatron_peer_names_what_it_looked_for(no_megatron):
    module, why = megatron_peer.load()
    assert module is None
    assert "megatron-core is not installed" in why and megatron_peer.FILE_ENV in why


def test_megatron_peer_from_a_named_file_and_from_a_wheel(no_megatron, tmp_path, monkeypatch):
    import zipfile

    path = tmp_path / "fused_kv_append_kernel.py"
    path.write_text(FAKE_KERNEL)
    monkeypatch.setenv(megatron_peer.FILE_ENV, str(path))
    module, where = megatron_peer.load()
    assert where == f"${megatron_peer.FILE_ENV} {path}" and module.CALLS == []

    monkeypatch.setattr(megatron_peer, "_CACHE", {})
    monkeypatch.delenv(megatron_peer.FILE_ENV)
    with zipfile.ZipFile(tmp_path / "megatron_core-0.16.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr(megatron_peer.KERNEL_PATH, FAKE_KERNEL)
    monkeypatch.setenv(megatron_peer.WHEEL_DIR_ENV, str(tmp_path))
    module, where = megatron_peer.load()
    assert where.startswith(f"wheel in ${megatron_peer.WHEEL_DIR_ENV}") and module is not None
    runner, why = megatron_peer.runner(torch.zeros(2, 1, 2, 4, 1, 8), torch.zeros(1, 1, 8),
                                       torch.zeros(1, 1, 8), torch.zeros(1, dtype=torch.int32),
                                       torch.zeros(1, dtype=torch.int32))
    assert runner is None and why == "Megatron-Core's kernel runs on CUDA tensors only"


def test_megatron_peer_finds_the_installed_megatron_core():
    path = megatron_peer._installed_path()  # the test extra installs megatron-core 0.16.1
    assert path is not None and path.name == "fused_kv_append_kernel.py"


def test_select_tunings_by_preset_and_name(toy):
    import_kernel_modules(quiet=True)
    every = [t.name for t in select_tunings(None, "all")]
    assert TOY in every  # a kernel outside KERNEL_MODULES still belongs to "all"
    for preset, modules in PRESET_MODULES.items():
        assert all(module_of(t) in modules for t in select_tunings(None, preset))
    assert [t.name for t in select_tunings([TOY])] == [TOY]
    with pytest.raises(SystemExit, match="no registered kernel"):
        select_tunings(["no_such_kernel"])
