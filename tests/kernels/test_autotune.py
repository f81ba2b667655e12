"""The autotune registry's lookup, validation and file format (kernels/autotune.py).

Runs in the normal pytest process and launches no kernel: a toy ``KernelTuning`` registered
under a test-only name stands in for a real kernel, and the packaged and override folders are
temporary ones.
"""

from __future__ import annotations

import json
import logging

import pytest

from dynctx.kernels import autotune
from dynctx.kernels.autotune import KernelConfig, KernelTuning

TOY = "toy_test_only_kernel"
DEVICE = "cpu"  # what device_name() gives for a CPU tensor outside the interpreter
SPACE = [KernelConfig.make(BLOCK=b, num_warps=w) for b in (16, 32, 64) for w in (4, 8)]
DEFAULT = KernelConfig.make(BLOCK=32, num_warps=4)
STALE = KernelConfig.make(BLOCK=128, num_warps=4)


def toy_key(num_tokens: int, width: int = 64, dtype: str = "float16") -> dict:
    return {"num_tokens": autotune.bucket_tokens(num_tokens), "width": width, "dtype": dtype}


@pytest.fixture
def toy(monkeypatch, tmp_path):
    """Registers the toy kernel, points the packaged and override folders at empty temporary
    ones and forgets earlier warnings; monkeypatch undoes all of it."""
    tuning = KernelTuning(name=TOY, configs=lambda key: list(SPACE),
                          default_config=lambda key: DEFAULT,
                          tune_key=lambda **shapes: toy_key(**shapes),
                          presets=lambda: [toy_key(1), toy_key(64)])
    monkeypatch.setitem(autotune._TUNINGS, TOY, tuning)
    monkeypatch.setattr(autotune, "_WARNED", set())
    monkeypatch.setattr(autotune, "PACKAGED_DIR", tmp_path / "packaged")
    (tmp_path / "override").mkdir()  # a $DYNCTX_AUTOTUNE_DIR that names no folder is an error
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path / "override"))
    return tuning


def entry(key: dict, config: KernelConfig, time_us: float = 5.0) -> dict:
    return {"key": key, "config": config.to_dict(), "times_us": {str(config): time_us}}


def write(root, entries: list[dict], *, kernel: str = TOY, device: str = DEVICE):
    path = root / device / f"{kernel}.json"
    autotune.write_cache_file(path, device=device, kernel=kernel, entries=entries,
                               versions={"torch": "test", "triton": "test"})
    return path


def packaged(tmp_path):
    return tmp_path / "packaged"


def override(tmp_path):
    return tmp_path / "override"


def test_toy_is_registered_and_removed_afterwards(toy):
    assert autotune.get_tuning(TOY) is toy
    assert TOY in autotune.registered()


def test_toy_is_gone_outside_the_fixture():
    assert TOY not in autotune.registered()


def test_override_beats_packaged(toy, tmp_path):
    a, b = SPACE[0], SPACE[1]
    write(packaged(tmp_path), [entry(toy_key(8), a)])
    path = write(override(tmp_path), [entry(toy_key(8), b)])
    config, source = autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert config == b
    assert source == f"override-exact:{path}"


def test_packaged_used_when_override_lacks_the_kernel(toy, tmp_path):
    path = write(packaged(tmp_path), [entry(toy_key(8), SPACE[2])])
    config, source = autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert (config, source) == (SPACE[2], f"packaged-exact:{path}")


def test_packaged_used_when_override_has_only_other_shapes(toy, tmp_path):
    write(override(tmp_path), [entry(toy_key(8, width=128), SPACE[0])])
    write(packaged(tmp_path), [entry(toy_key(8), SPACE[3])])
    config, source = autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert config == SPACE[3] and source.startswith("packaged-exact:")


def test_exact_beats_nearest(toy, tmp_path):
    write(packaged(tmp_path), [entry(toy_key(4), SPACE[0]), entry(toy_key(8), SPACE[1]),
                               entry(toy_key(16), SPACE[2])])
    config, source = autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert config == SPACE[1] and source.startswith("packaged-exact:")


def test_exact_in_packaged_loses_to_nearest_in_override(toy, tmp_path):
    """The override folder is searched first, nearest bucket included."""
    write(override(tmp_path), [entry(toy_key(16), SPACE[0])])
    write(packaged(tmp_path), [entry(toy_key(8), SPACE[1])])
    config, source = autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert config == SPACE[0] and source.startswith("override-nearest:")


@pytest.mark.parametrize("query, entries, expected", [
    pytest.param(8, (4, 64), 4, id="8-picks-4-over-64"),
    pytest.param(32, (4, 64), 64, id="32-picks-64-over-4"),
    pytest.param(1, (2, 1024), 2, id="1-picks-2"),
    pytest.param(8192, (1, 256), 256, id="8192-picks-256"),
    pytest.param(8, (4, 16), 16, id="tie-picks-the-larger-bucket"),
])
def test_nearest_bucket_is_the_closest_power_of_two(toy, tmp_path, query, entries, expected):
    configs = dict(zip(entries, SPACE))
    write(packaged(tmp_path), [entry(toy_key(tokens), configs[tokens]) for tokens in entries])
    config, source = autotune.resolve_config(TOY, toy_key(query), DEVICE)
    assert config == configs[expected]
    assert source.startswith("packaged-nearest:")


def test_nearest_needs_every_other_key_field_equal(toy, tmp_path):
    write(packaged(tmp_path), [entry(toy_key(8, width=128), SPACE[0]),
                               entry(toy_key(8, dtype="bfloat16"), SPACE[1])])
    assert autotune.resolve_config(TOY, toy_key(8), DEVICE) == (DEFAULT, "default")


def test_default_when_nothing_matches_is_logged_once(toy, caplog):
    caplog.set_level(logging.DEBUG, logger="dynctx.autotune")
    for _ in range(3):
        assert autotune.resolve_config(TOY, toy_key(8), DEVICE) == (DEFAULT, "default")
    messages = [r.getMessage() for r in caplog.records if r.name == "dynctx.autotune"]
    assert len(messages) == 1
    assert TOY in messages[0]
    assert f"python -m dynctx autotune tune --kernel {TOY}" in messages[0]


def test_default_is_logged_again_for_another_key(toy, caplog):
    caplog.set_level(logging.DEBUG, logger="dynctx.autotune")
    autotune.resolve_config(TOY, toy_key(8), DEVICE)
    autotune.resolve_config(TOY, toy_key(16), DEVICE)
    assert len([r for r in caplog.records if r.name == "dynctx.autotune"]) == 2


def test_default_on_a_gpu_device_name_logs_at_info(toy, caplog, monkeypatch):
    monkeypatch.setattr(autotune, "device_name", lambda device=None: "NVIDIA_TEST")
    caplog.set_level(logging.INFO, logger="dynctx.autotune")
    autotune.resolve_config(TOY, toy_key(8), "cuda")
    assert [r.levelno for r in caplog.records if r.name == "dynctx.autotune"] == [logging.INFO]


def test_unknown_kernel_raises_key_error():
    with pytest.raises(KeyError, match="no kernel named"):
        autotune.resolve_config("no_such_kernel_anywhere", {"num_tokens": 1}, DEVICE)


def test_register_twice_raises(toy):
    with pytest.raises(ValueError, match="registered twice"):
        autotune.register(KernelTuning(name=TOY, configs=toy.configs,
                                        default_config=toy.default_config, tune_key=toy.tune_key))
    assert autotune.register(toy) is toy  # the same object again is fine


def test_stale_config_is_ignored_with_a_warning(toy, tmp_path):
    path = write(override(tmp_path), [entry(toy_key(8), STALE)])
    with pytest.warns(UserWarning, match="outside the search space") as record:
        config, source = autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert (config, source) == (DEFAULT, "default")
    assert str(path) in str(record[0].message)


def test_stale_exact_falls_back_to_a_valid_nearest_then_packaged(toy, tmp_path):
    write(override(tmp_path), [entry(toy_key(8), STALE), entry(toy_key(16), SPACE[4])])
    with pytest.warns(UserWarning, match="outside the search space"):
        config, source = autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert config == SPACE[4] and source.startswith("override-nearest:")


def test_stale_warning_is_given_once(toy, tmp_path, recwarn):
    write(override(tmp_path), [entry(toy_key(8), STALE)])
    for _ in range(3):
        autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert len([w for w in recwarn if "outside the search space" in str(w.message)]) == 1


def _valid_data() -> dict:
    return {"format": autotune.FORMAT_VERSION, "device": DEVICE, "kernel": TOY,
            "versions": {"torch": "test"}, "entries": [entry(toy_key(8), SPACE[0])]}


def _broken(change):
    data = _valid_data()
    change(data)
    return json.dumps(data)


MALFORMED = [
    pytest.param("{not json", id="not-json"),
    pytest.param("", id="empty"),
    pytest.param("[]", id="top-level-list"),
    pytest.param(_broken(lambda d: d.pop("entries")), id="no-entries"),
    pytest.param(_broken(lambda d: d.pop("versions")), id="no-versions"),
    pytest.param(_broken(lambda d: d.update(format=99)), id="wrong-format"),
    pytest.param(_broken(lambda d: d.update(entries={"a": 1})), id="entries-not-a-list"),
    pytest.param(_broken(lambda d: d.update(entries=["x"])), id="entry-not-an-object"),
    pytest.param(_broken(lambda d: d["entries"][0].pop("config")), id="entry-without-config"),
    pytest.param(_broken(lambda d: d["entries"][0].update(key=[1])), id="key-not-an-object"),
    pytest.param(_broken(lambda d: d["entries"][0].update(config={"meta": {}})),
                 id="config-without-warps"),
    pytest.param(_broken(lambda d: d["entries"][0].update(config={"meta": 3, "num_warps": 4,
                                                                  "num_stages": 1})),
                 id="config-meta-not-an-object"),
    pytest.param(_broken(lambda d: d["entries"][0].update(times_us={})), id="no-times"),
    pytest.param(_broken(lambda d: d["entries"][0].update(times_us={"x": 0})), id="zero-time"),
    pytest.param(_broken(lambda d: d["entries"][0].update(times_us={"x": "fast"})),
                 id="time-not-a-number"),
    pytest.param(_broken(lambda d: d["entries"].append(d["entries"][0])), id="repeated-key"),
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_file_raises_value_error_naming_it(toy, tmp_path, text):
    path = override(tmp_path) / DEVICE / f"{TOY}.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        autotune.resolve_config(TOY, toy_key(8), DEVICE)
    assert str(path) in str(info.value)


def test_valid_data_passes_validation():
    autotune.validate_cache_data(_valid_data(), "x.json")


def test_a_rewritten_file_is_read_again(toy, tmp_path):
    """The parsed-file cache is keyed on modification time and size, not the path alone."""
    write(override(tmp_path), [entry(toy_key(8), SPACE[0])])
    assert autotune.resolve_config(TOY, toy_key(8), DEVICE)[0] == SPACE[0]
    write(override(tmp_path), [entry(toy_key(8), SPACE[5], time_us=12.5)])
    assert autotune.resolve_config(TOY, toy_key(8), DEVICE)[0] == SPACE[5]


def test_a_lookup_is_cached_per_key(toy, tmp_path, monkeypatch):
    """A second lookup of the same key reads no file and builds no search space; another key,
    another override folder or another packaged folder is looked up afresh."""
    write(override(tmp_path), [entry(toy_key(8), SPACE[1]), entry(toy_key(16), SPACE[2])])
    assert autotune.resolve_config(TOY, toy_key(8), DEVICE)[0] == SPACE[1]
    reads = []
    monkeypatch.setattr(autotune, "load_cache_file",
                        lambda path: reads.append(path) or autotune._load_file(
                            str(path), path.stat().st_mtime_ns, path.stat().st_size))
    for _ in range(3):
        assert autotune.resolve_config(TOY, toy_key(8), DEVICE) == (
            SPACE[1], f"override-exact:{override(tmp_path) / DEVICE / (TOY + '.json')}")
    assert reads == []
    assert autotune.resolve_config(TOY, toy_key(16), DEVICE)[0] == SPACE[2]
    assert len(reads) == 1
    other = tmp_path / "other"
    write(other, [entry(toy_key(8), SPACE[3])])
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(other))
    assert autotune.resolve_config(TOY, toy_key(8), DEVICE)[0] == SPACE[3]
    monkeypatch.delenv(autotune.OVERRIDE_ENV)
    write(tmp_path / "packaged2", [entry(toy_key(8), SPACE[4])])
    monkeypatch.setattr(autotune, "PACKAGED_DIR", tmp_path / "packaged2")
    assert autotune.resolve_config(TOY, toy_key(8), DEVICE)[0] == SPACE[4]


def test_a_lookup_cached_for_one_tuning_is_not_served_to_another(toy, monkeypatch):
    """Tests swap the tuning registered under a name: the cache answers only for the tuning it
    was resolved for."""
    assert autotune.resolve_config(TOY, toy_key(8), DEVICE) == (DEFAULT, "default")
    other = KernelTuning(name=TOY, configs=lambda key: list(SPACE),
                         default_config=lambda key: SPACE[5], tune_key=toy.tune_key)
    monkeypatch.setitem(autotune._TUNINGS, TOY, other)
    assert autotune.resolve_config(TOY, toy_key(8), DEVICE) == (SPACE[5], "default")


def test_write_cache_file_is_canonical_and_round_trips(tmp_path):
    entries = [entry(toy_key(64), SPACE[3], 7.25), entry(toy_key(1), SPACE[0], 1.5),
               entry(toy_key(8, dtype="bfloat16"), SPACE[1], 3.0)]
    versions = {"triton": "3.9.0", "torch": "2.13.0", "git_revision": "abc"}
    path = tmp_path / DEVICE / f"{TOY}.json"
    autotune.write_cache_file(path, device=DEVICE, kernel=TOY, entries=entries, versions=versions)
    text = path.read_text()
    data = json.loads(text)
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert text == json.dumps(data, sort_keys=True, indent=2) + "\n"
    assert text == autotune.canonical_json(data)
    assert "\n  \"device\"" in text  # two-space indent
    sort_key = [json.dumps(e["key"], sort_keys=True) for e in data["entries"]]
    assert sort_key == sorted(sort_key)
    assert data["device"] == DEVICE and data["kernel"] == TOY and data["versions"] == versions
    assert data["format"] == autotune.FORMAT_VERSION
    as_text = lambda items: sorted(json.dumps(e, sort_keys=True) for e in items)  # noqa: E731
    assert as_text(data["entries"]) == as_text(entries)
    assert autotune.load_cache_file(path) == data
    # Writing what was read gives the same bytes: a re-tune with equal results is no diff.
    autotune.write_cache_file(path, device=DEVICE, kernel=TOY, entries=data["entries"][::-1],
                               versions=versions)
    assert path.read_text() == text


def test_write_cache_file_refuses_malformed_entries(tmp_path):
    path = tmp_path / DEVICE / f"{TOY}.json"
    with pytest.raises(ValueError, match="no measured times"):
        autotune.write_cache_file(path, device=DEVICE, kernel=TOY, versions={},
                                   entries=[{"key": toy_key(1), "config": SPACE[0].to_dict(),
                                             "times_us": {}}])
    assert not path.exists()


def test_kernel_config_round_trips_and_prints():
    config = KernelConfig.make(BLOCK_T=4, BLOCK_H=8, num_warps=8, num_stages=2)
    assert KernelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert str(config) == "BLOCK_H=8,BLOCK_T=4,w8,s2"
    assert config.launch_kwargs() == {"BLOCK_H": 8, "BLOCK_T": 4, "num_warps": 8, "num_stages": 2}
    assert KernelConfig.make(B=1, A=2) == KernelConfig.make(A=2, B=1)


@pytest.mark.parametrize("tokens, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8),
                                            (8, 8), (9, 16), (8191, 8192), (8193, 16384)])
def test_bucket_tokens(tokens, bucket):
    assert autotune.bucket_tokens(tokens) == bucket


def test_bucket_tokens_rejects_negative():
    with pytest.raises(ValueError, match=">= 0"):
        autotune.bucket_tokens(-1)


def test_device_name_off_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert autotune.device_name("cpu") == "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert autotune.device_name("cpu") == "interpreter"
