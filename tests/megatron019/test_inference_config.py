"""``InferenceConfig`` and its enums against Megatron-Core 0.19's, pinned.

The expectations below were read from ``megatron/core/inference/config.py`` at tag
``core_v0.19.0``. In CI (dynctx mode) they check ``dynctx.context.InferenceConfig``; run by
``run_port.py`` (megatron019 mode) the same tests check 0.19's own class, which is how the pins
are compared with the real class.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings

import pytest
import torch
from mcore019_port import (
    MODE,
    AsyncScheduleMode,
    CudaGraphSizingDistribution,
    InferenceConfig,
    KVCacheManagementMode,
    PrefixCachingCoordinatorPolicy,
    PrefixCachingEvictionPolicy,
)

#: 0.19's fields in declaration order, with their defaults; an enum default as (enum name, value).
FIELDS = [
    ("block_size_tokens", 256),
    ("buffer_size_gb", 20),
    ("paused_buffer_size_gb", None),
    ("mamba_inference_state_config", None),
    ("mamba_memory_ratio", None),
    ("max_requests", None),
    ("max_tokens", None),
    ("unified_memory_level", 0),
    ("kv_cache_management_mode", ("KVCacheManagementMode", "persist")),
    ("num_cuda_graphs", None),
    ("cuda_graph_mixed_prefill_count", 16),
    ("cuda_graph_sizing_distribution", ("CudaGraphSizingDistribution", "exponential")),
    ("use_cuda_graphs_for_non_decode_steps", True),
    ("cuda_graph_all_prefills", False),
    ("cuda_graph_max_tokens", 512),
    ("static_kv_memory_pointers", False),
    ("max_sequence_length", 2560),
    ("pg_collection", None),
    ("use_flashinfer_fused_rope", False),
    ("materialize_only_last_token_logits", True),
    ("enable_chunked_prefill", False),
    ("num_speculative_tokens", 0),
    ("enable_prefix_caching", False),
    ("prefix_caching_eviction_policy", ("PrefixCachingEvictionPolicy", "ref_zero")),
    ("prefix_caching_coordinator_policy", ("PrefixCachingCoordinatorPolicy", "load_balanced")),
    ("prefix_caching_routing_alpha", 0.5),
    ("prefix_caching_mamba_gb", None),
    ("track_paused_request_events", False),
    ("track_generated_token_events", False),
    ("metrics_writer", None),
    ("logging_step_interval", 0),
    ("sampling_backend", "torch"),
    ("offset_sampling_seed_by_dp_rank", True),
    ("async_sched_mode", ("AsyncScheduleMode", "legacy")),
    ("logprobs_mode", "raw_logprobs"),
    ("request_metadata_types", None),
    ("use_synchronous_zmq_collectives", False),
    ("disable_ep_consensus", False),
    ("ep_consensus_interval", 20),
]

#: Each enum's members (name, value), in 0.19's order; every one is a ``str`` enum.
ENUMS = {
    "PrefixCachingEvictionPolicy": [("REF_ZERO", "ref_zero"), ("LRU", "lru")],
    "PrefixCachingCoordinatorPolicy": [
        ("LONGEST_PREFIX", "longest_prefix"), ("FIRST_PREFIX_BLOCK", "first_prefix_block"),
        ("LOAD_BALANCED", "load_balanced"),
    ],
    "KVCacheManagementMode": [
        ("PERSIST", "persist"), ("OFFLOAD", "offload"), ("RECOMPUTE", "recompute"),
    ],
    "CudaGraphSizingDistribution": [("EXPONENTIAL", "exponential"), ("LINEAR", "linear")],
    "AsyncScheduleMode": [("LEGACY", "legacy"), ("ASYNC", "async")],
}
ENUM_CLASSES = {
    "PrefixCachingEvictionPolicy": PrefixCachingEvictionPolicy,
    "PrefixCachingCoordinatorPolicy": PrefixCachingCoordinatorPolicy,
    "KVCacheManagementMode": KVCacheManagementMode,
    "CudaGraphSizingDistribution": CudaGraphSizingDistribution,
    "AsyncScheduleMode": AsyncScheduleMode,
}

ALPHA_MESSAGE = "prefix_caching_routing_alpha must be in [0, 1], got {}"
LOGPROBS_MESSAGE = ("Unsupported logprobs_mode {!r}. Supported modes: raw_logprobs, "
                    "processed_logprobs.")
SPECULATIVE_MESSAGE = ("logprobs_mode='processed_logprobs' is not yet supported with "
                       "speculative decoding (num_speculative_tokens > 0).")
FLASHINFER_WARNING = ("sampling_backend='flashinfer' was requested but the flashinfer package "
                      "is not installed; falling back to sampling_backend='torch'.")


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def test_the_39_fields_in_order_with_their_defaults():
    fields = dataclasses.fields(InferenceConfig)
    assert [f.name for f in fields] == [name for name, _ in FIELDS]
    assert len(fields) == 39
    for field, (name, expected) in zip(fields, FIELDS):
        default = _default(field)
        if isinstance(expected, tuple):
            enum_name, value = expected
            assert isinstance(default, ENUM_CLASSES[enum_name]), name
            assert default.value == value, name
        else:
            assert type(default) is type(expected) and default == expected, name


def test_a_default_config_holds_the_defaults_and_verbose_is_init_only():
    config = InferenceConfig()
    for name, expected in FIELDS:
        value = getattr(config, name)
        if isinstance(expected, tuple):
            assert value == ENUM_CLASSES[expected[0]](expected[1]), name
        else:
            assert value == expected, name
    assert config._verbose is False
    assert "verbose" not in {f.name for f in dataclasses.fields(InferenceConfig)}
    assert "verbose" not in dataclasses.asdict(config)
    assert InferenceConfig(verbose=True)._verbose is True


def test_every_field_is_a_keyword_and_the_config_is_mutable():
    config = InferenceConfig(block_size_tokens=64, buffer_size_gb=0.5, max_requests=8,
                             request_metadata_types=[("temperature", torch.float32)])
    assert (config.block_size_tokens, config.buffer_size_gb, config.max_requests) == (64, 0.5, 8)
    # 0.19's context writes back into the config it is given (use_flashinfer_fused_rope=None).
    config.use_flashinfer_fused_rope = True
    assert config.use_flashinfer_fused_rope is True
    assert InferenceConfig() == InferenceConfig()
    assert InferenceConfig(max_tokens=128) != InferenceConfig()


@pytest.mark.parametrize("enum_name", sorted(ENUMS))
def test_enum_members_and_values(enum_name):
    cls = ENUM_CLASSES[enum_name]
    assert [(m.name, m.value) for m in cls] == ENUMS[enum_name]
    for member in cls:
        assert isinstance(member, str) and member == member.value  # str enums
        assert cls(member.value) is member


def test_async_sched_mode_is_converted_to_the_enum():
    config = InferenceConfig(async_sched_mode="async")
    assert config.async_sched_mode is AsyncScheduleMode.ASYNC
    assert InferenceConfig(async_sched_mode=AsyncScheduleMode.LEGACY).async_sched_mode is (
        AsyncScheduleMode.LEGACY)
    with pytest.raises(ValueError, match="'overlap' is not a valid AsyncScheduleMode"):
        InferenceConfig(async_sched_mode="overlap")


def test_the_other_enum_fields_are_kept_as_given():
    # 0.19 converts only async_sched_mode; a plain string compares equal to its member.
    config = InferenceConfig(kv_cache_management_mode="offload",
                             prefix_caching_eviction_policy="lru",
                             cuda_graph_sizing_distribution="linear")
    assert config.kv_cache_management_mode == "offload"
    assert type(config.kv_cache_management_mode) is str
    assert config.kv_cache_management_mode == KVCacheManagementMode.OFFLOAD
    assert config.prefix_caching_eviction_policy == PrefixCachingEvictionPolicy.LRU
    assert config.cuda_graph_sizing_distribution == CudaGraphSizingDistribution.LINEAR


@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0, 1])
def test_prefix_caching_routing_alpha_in_range(alpha):
    assert InferenceConfig(prefix_caching_routing_alpha=alpha).prefix_caching_routing_alpha == alpha


@pytest.mark.parametrize("alpha", [-0.01, 1.5, -1, math.nan, math.inf])
def test_prefix_caching_routing_alpha_out_of_range_raises(alpha):
    with pytest.raises(ValueError) as info:
        InferenceConfig(prefix_caching_routing_alpha=alpha)
    assert str(info.value) == ALPHA_MESSAGE.format(alpha)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_modes(mode):
    assert InferenceConfig(logprobs_mode=mode).logprobs_mode == mode


@pytest.mark.parametrize("mode", ["logprobs", "RAW_LOGPROBS", None])
def test_unknown_logprobs_mode_raises(mode):
    with pytest.raises(ValueError) as info:
        InferenceConfig(logprobs_mode=mode)
    assert str(info.value) == LOGPROBS_MESSAGE.format(mode)


def test_processed_logprobs_with_speculative_tokens_raises():
    assert InferenceConfig(logprobs_mode="raw_logprobs",
                           num_speculative_tokens=3).num_speculative_tokens == 3
    assert InferenceConfig(logprobs_mode="processed_logprobs",
                           num_speculative_tokens=0).logprobs_mode == "processed_logprobs"
    with pytest.raises(ValueError) as info:
        InferenceConfig(logprobs_mode="processed_logprobs", num_speculative_tokens=1)
    assert str(info.value) == SPECULATIVE_MESSAGE


def test_checks_run_in_0_19_order():
    # Several bad values at once: the first check in 0.19's order is the one that raises.
    with pytest.raises(ValueError, match="not a valid AsyncScheduleMode"):
        InferenceConfig(async_sched_mode="x", prefix_caching_routing_alpha=2.0, logprobs_mode="x")
    with pytest.raises(ValueError, match="prefix_caching_routing_alpha"):
        InferenceConfig(prefix_caching_routing_alpha=2.0, logprobs_mode="x")
    with pytest.raises(ValueError, match="Unsupported logprobs_mode"):
        InferenceConfig(logprobs_mode="x", num_speculative_tokens=2)


def test_flashinfer_sampling_without_flashinfer_warns_and_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises
    with pytest.warns(UserWarning) as record:
        config = InferenceConfig(sampling_backend="flashinfer")
    assert [str(w.message) for w in record] == [FLASHINFER_WARNING]
    assert config.sampling_backend == "torch"


def test_torch_sampling_does_not_look_for_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert InferenceConfig(sampling_backend="torch").sampling_backend == "torch"


def test_the_module_is_megatrons_in_megatron019_mode_and_dynctxs_otherwise():
    module = InferenceConfig.__module__
    if MODE == "megatron019":
        assert module == "megatron.core.inference.config"
    else:
        assert module == "dynctx.context.config"
        import dynctx.context as dc
        from dynctx.context import config, prefix_cache

        assert dc.InferenceConfig is config.InferenceConfig
        # One eviction-policy enum: the prefix cache's, which is 0.19's.
        assert config.PrefixCachingEvictionPolicy is prefix_cache.PrefixCachingEvictionPolicy
        assert dc.PrefixCachingEvictionPolicy is prefix_cache.PrefixCachingEvictionPolicy
