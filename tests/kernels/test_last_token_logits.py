"""last_token_logits and token_log_probs: Triton kernel against the torch reference.

Runs compiled on CUDA, or on a CPU under TRITON_INTERPRET=1 (set before pytest starts:
``TRITON_INTERPRET=1 python -m pytest -m interpreter tests/kernels/test_last_token_logits.py``).
The gather is bit-exact in every dtype; the log-softmax is compared with the fp32 reference of
the same (upcast) logits within LOG_SOFTMAX_TOLERANCE.
"""

import pytest
import torch
from kernel_test_utils import DEVICE, DTYPES, assert_raises_naming, check_tune_case, poisoned
from tolerances import LOG_SOFTMAX_TOLERANCE

from dynctx.kernels import autotune
from dynctx.kernels.last_token_logits import (
    last_token_logits,
    last_token_logits_configs,
    last_token_logits_default_config,
    last_token_logits_ref,
    last_token_logits_tune_key,
    scaled_down_key,
    token_log_probs,
    token_log_probs_configs,
    token_log_probs_default_config,
    token_log_probs_ref,
    token_log_probs_tune_key,
)

pytestmark = pytest.mark.interpreter

GUARD = 3

# (query lengths of the real requests, padding tokens after them, vocab size)
SHAPES = [
    pytest.param([], 0, 77, id="zero_requests"),
    pytest.param([], 3, 77, id="zero_requests_padding"),
    pytest.param([1], 0, 77, id="one_token"),
    pytest.param([1] * 5, 0, 1031, id="decode5"),
    pytest.param([3, 7, 1], 0, 77, id="prefill"),
    pytest.param([1, 1, 4, 2], 0, 2500, id="mixed"),
    pytest.param([1, 1, 3], 4, 77, id="mixed_padding"),
]


def _logits(num_tokens, vocab_size, dtype, *, seed=0, row_pad=5):
    """Random logits ``[T, V]`` with a row stride larger than ``V`` (a view of a wider buffer)."""
    gen = torch.Generator().manual_seed(seed)
    wide = (3 * torch.randn(num_tokens, vocab_size + row_pad, generator=gen)).to(dtype)
    return wide.to(DEVICE)[:, :vocab_size]


def _cu(query_lengths, padding_tokens):
    """cu_query_lengths of the padded step: the real requests, then cumulative padding entries."""
    cu = [0]
    for q in query_lengths:
        cu.append(cu[-1] + q)
    cu += [cu[-1]] * 2
    return (torch.tensor(cu, dtype=torch.int32, device=DEVICE),
            cu[len(query_lengths)] + padding_tokens)


def _guarded(rows, cols, dtype):
    """A poisoned buffer and the ``[rows, cols]`` view inside it, guard bands all around.

    The poison is 0xFF bytes, a NaN in every float dtype whose bits no kernel produces (its
    own NaNs are canonical), so the guard bands are checked byte for byte.
    """
    return poisoned((rows, cols), dtype, 0xFF, DEVICE, guard=GUARD)


def _assert_guard_untouched(buf, rows, cols):
    inner = torch.zeros(buf.shape, dtype=torch.bool, device=buf.device)
    inner[GUARD:GUARD + rows, GUARD:GUARD + cols] = True
    guard_bytes = buf.view(torch.uint8).view(buf.shape[0], buf.shape[1], -1)[~inner]
    assert bool((guard_bytes == 0xFF).all()), "the kernel wrote outside its output"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lengths, padding, vocab_size", SHAPES)
def test_gather_matches_reference(query_lengths, padding, vocab_size, dtype):
    cu, num_tokens = _cu(query_lengths, padding)
    logits = _logits(num_tokens, vocab_size, dtype)
    num_requests = len(query_lengths)
    buf, out = _guarded(num_requests, vocab_size, dtype)
    got = last_token_logits(logits, cu, num_requests, out=out, backend="triton")
    assert got.data_ptr() == out.data_ptr() or num_requests == 0
    expected = last_token_logits_ref(logits, cu, num_requests)
    assert torch.equal(out, expected)
    _assert_guard_untouched(buf, num_requests, vocab_size)
    # Allocating form, and the [1, T, V] form the model hands over.
    assert torch.equal(last_token_logits(logits[None], cu, num_requests, backend="triton"),
                       expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lengths, padding, vocab_size", SHAPES)
def test_log_softmax_matches_reference(query_lengths, padding, vocab_size, dtype):
    cu, num_tokens = _cu(query_lengths, padding)
    logits = _logits(num_tokens, vocab_size, dtype, seed=1)
    num_requests = len(query_lengths)
    buf, out = _guarded(num_requests, vocab_size, torch.float32)
    last_token_logits(logits, cu, num_requests, log_softmax=True, out=out, backend="triton")
    expected = last_token_logits_ref(logits, cu, num_requests, log_softmax=True)
    assert expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, **LOG_SOFTMAX_TOLERANCE)
    _assert_guard_untouched(buf, num_requests, vocab_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, vocab_size", [
    pytest.param(0, 77, id="zero_tokens"),
    pytest.param(1, 77, id="one_token"),
    pytest.param(6, 9000, id="six_tokens_9000_vocab"),
])
@pytest.mark.parametrize("return_full",
                         [pytest.param(False, id="picked"), pytest.param(True, id="full")])
def test_token_log_probs_matches_reference(num_tokens, vocab_size, dtype, return_full):
    logits = _logits(num_tokens, vocab_size, dtype, seed=2)
    gen = torch.Generator().manual_seed(3)
    token_ids = torch.randint(0, vocab_size, (num_tokens,), generator=gen).to(DEVICE)
    if num_tokens > 1:
        token_ids[0], token_ids[-1] = 0, vocab_size - 1
    got, full = token_log_probs(logits, token_ids, return_full=return_full, backend="triton")
    expected, expected_full = token_log_probs_ref(logits, token_ids, return_full=return_full)
    assert got.dtype == torch.float32 and got.shape == (num_tokens,)
    torch.testing.assert_close(got, expected, **LOG_SOFTMAX_TOLERANCE)
    if return_full:
        torch.testing.assert_close(full, expected_full, **LOG_SOFTMAX_TOLERANCE)
    else:
        assert full is None


def test_token_log_probs_int32_ids_and_3d_logits():
    logits = _logits(4, 300, torch.float16, seed=4)
    token_ids = torch.tensor([5, 0, 299, 17], dtype=torch.int32, device=DEVICE)
    got, _ = token_log_probs(logits[None], token_ids, backend="triton")
    torch.testing.assert_close(got, token_log_probs_ref(logits, token_ids)[0],
                               **LOG_SOFTMAX_TOLERANCE)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_invalid_indices_give_nan_without_reading_out_of_bounds():
    logits = _logits(3, 50, torch.float32, seed=5)
    token_ids = torch.tensor([50, -1, 7], device=DEVICE)
    got, _ = token_log_probs(logits, token_ids, backend="triton")
    assert torch.isnan(got[:2]).all()
    torch.testing.assert_close(got[2], token_log_probs_ref(logits, token_ids.clamp(0, 49))[0][2],
                               **LOG_SOFTMAX_TOLERANCE)
    cu = torch.tensor([0, 1, 9], dtype=torch.int32, device=DEVICE)
    gathered = last_token_logits(logits, cu, 2, backend="triton")
    assert torch.equal(gathered[0], logits[0]) and torch.isnan(gathered[1]).all()
    assert torch.isnan(
        last_token_logits(logits, cu, 2, log_softmax=True, backend="triton")[1]).all()


# Every config of each search space, on vocabularies with several tiles for the small blocks
# (gather 2500 > 2 * 1024; log-softmax 9000 > 2 * 4096) and one partial tile for the large ones.
SOFTMAX_VOCAB = 9000
GATHER_KEY = last_token_logits_tune_key(vocab_size=2500, dtype=torch.bfloat16, num_requests=3)
SOFTMAX_KEY = last_token_logits_tune_key(vocab_size=SOFTMAX_VOCAB, dtype=torch.bfloat16,
                                         num_requests=3, log_softmax=True)


@pytest.mark.parametrize("config", [pytest.param(c, id=str(c))
                                    for c in last_token_logits_configs(GATHER_KEY)])
def test_every_gather_config(config):
    cu, num_tokens = _cu([2, 1, 3], 1)
    logits = _logits(num_tokens, 2500, torch.bfloat16, seed=6)
    buf, out = _guarded(3, 2500, torch.bfloat16)
    last_token_logits(logits, cu, 3, out=out, config=config, backend="triton")
    assert torch.equal(out, last_token_logits_ref(logits, cu, 3))
    _assert_guard_untouched(buf, 3, 2500)


@pytest.mark.parametrize("config", [pytest.param(c, id=str(c))
                                    for c in last_token_logits_configs(SOFTMAX_KEY)])
def test_every_log_softmax_config(config):
    cu, num_tokens = _cu([2, 1, 3], 1)
    logits = _logits(num_tokens, SOFTMAX_VOCAB, torch.bfloat16, seed=7)
    buf, out = _guarded(3, SOFTMAX_VOCAB, torch.float32)
    last_token_logits(logits, cu, 3, log_softmax=True, out=out, config=config, backend="triton")
    torch.testing.assert_close(out, last_token_logits_ref(logits, cu, 3, log_softmax=True),
                               **LOG_SOFTMAX_TOLERANCE)
    _assert_guard_untouched(buf, 3, SOFTMAX_VOCAB)


@pytest.mark.parametrize("config",
                         [pytest.param(c, id=str(c)) for c in token_log_probs_configs({})])
def test_every_token_log_probs_config(config):
    logits = _logits(2, SOFTMAX_VOCAB, torch.float16, seed=8)
    # Row 0 peaks in its last tile, so the running max is rescaled on the way.
    logits[0, -5] = 40.0
    token_ids = torch.tensor([SOFTMAX_VOCAB - 5, 2499], device=DEVICE)
    got, full = token_log_probs(logits, token_ids, return_full=True, config=config,
                                backend="triton")
    expected, expected_full = token_log_probs_ref(logits, token_ids, return_full=True)
    torch.testing.assert_close(got, expected, **LOG_SOFTMAX_TOLERANCE)
    torch.testing.assert_close(full, expected_full, **LOG_SOFTMAX_TOLERANCE)


def test_default_configs_are_in_search_space():
    for vocab_size in (77, 5000, 128256):
        for log_softmax in (False, True):
            key = last_token_logits_tune_key(vocab_size=vocab_size, dtype=torch.bfloat16,
                                             num_requests=5, log_softmax=log_softmax)
            assert last_token_logits_default_config(key) in last_token_logits_configs(key)
            assert key["num_requests"] == 8
        key = token_log_probs_tune_key(vocab_size=vocab_size, dtype=torch.float16, num_tokens=9)
        assert token_log_probs_default_config(key) in token_log_probs_configs(key)
        assert key["num_tokens"] == 16


def test_custom_ops_match_reference():
    cu, num_tokens = _cu([1, 3], 0)
    logits = _logits(num_tokens, 40, torch.float32, seed=9)
    assert torch.equal(torch.ops.dynctx.last_token_logits(logits, cu, 2, False),
                       last_token_logits_ref(logits, cu, 2))
    token_ids = torch.tensor([1, 2, 3, 39], device=DEVICE)
    log_probs, full = torch.ops.dynctx.token_log_probs(logits, token_ids, False)
    torch.testing.assert_close(log_probs, token_log_probs_ref(logits, token_ids)[0])
    assert full.shape == (0, 40)
    torch.library.opcheck(torch.ops.dynctx.last_token_logits.default, (logits, cu, 2, True))
    torch.library.opcheck(torch.ops.dynctx.token_log_probs.default, (logits, token_ids, True))


@pytest.mark.parametrize("name", ["last_token_logits", "token_log_probs"])
def test_tune_cases_check_at_scaled_down_presets(name):
    tuning = autotune.get_tuning(name)
    for key in tuning.presets():
        small = scaled_down_key(key)
        assert tuning.configs(small) == tuning.configs(key)
        check_tune_case(tuning, small)


def _bad_calls():
    logits = torch.zeros(4, 10, device=DEVICE)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    ids = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    return [
        pytest.param(lambda: last_token_logits(logits.long(), cu, 2), "logits", id="int_logits"),
        pytest.param(lambda: last_token_logits(logits[None, None], cu, 2), "logits",
                     id="4d_logits"),
        pytest.param(lambda: last_token_logits(torch.zeros(2, 4, 10), cu, 2), "logits",
                     id="batch2"),
        pytest.param(lambda: last_token_logits(logits, cu.long(), 2), "cu_query_lengths",
                     id="cu_int64"),
        pytest.param(lambda: last_token_logits(logits, cu, 3), "cu_query_lengths", id="cu_short"),
        pytest.param(lambda: last_token_logits(logits, cu, -1), "num_requests",
                     id="negative_requests"),
        pytest.param(lambda: last_token_logits(logits, cu, 2,
                                               out=torch.empty(3, 10, device=DEVICE)),
                     "out", id="out_shape"),
        pytest.param(lambda: last_token_logits(logits.half(), cu, 2, log_softmax=True,
                                               out=torch.empty(2, 10, dtype=torch.float16,
                                                               device=DEVICE)),
                     "out", id="out_dtype"),
        pytest.param(lambda: token_log_probs(logits, ids[:3]), "token_ids", id="ids_length"),
        pytest.param(lambda: token_log_probs(logits, ids.float()), "token_ids", id="ids_dtype"),
        pytest.param(lambda: token_log_probs(logits, ids[None]), "token_ids", id="ids_2d"),
    ]


@pytest.mark.parametrize("call, name", _bad_calls())
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs_raise(call, name, backend, monkeypatch):
    assert_raises_naming(call, name, backend, monkeypatch)
