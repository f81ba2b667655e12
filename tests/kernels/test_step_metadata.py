"""step_metadata: Triton kernel and torch reference against a token-by-token Python oracle.

Runs compiled on CUDA, or on a CPU under TRITON_INTERPRET=1 (set before pytest starts).
Every output lives inside a poisoned buffer (0xFF bytes, then 0x5A bytes, so a skipped -1 write
is caught too) with room past ``padded_tokens``/``padded_requests`` and guard bands; the whole
buffer must equal the oracle's. Inputs carry junk past the entries the kernel may read.
"""

import pytest
import torch
from kernel_test_utils import DEVICE, POISONS, assert_raises_naming, check_tune_case, poisoned

from dynctx.kernels import autotune
from dynctx.kernels.step_metadata import (
    TOKEN_OUTPUTS,
    scaled_down_key,
    step_metadata,
    step_metadata_configs,
    step_metadata_default_config,
    step_metadata_ref,
    step_metadata_tune_key,
)

pytestmark = pytest.mark.interpreter

GUARD = 2
SPARE = 3  # entries past padded_tokens / rows past padded_requests that must stay untouched
DUMMY_BLOCK = 4242


def _with_junk(values, dtype, junk=99):
    return torch.tensor(list(values) + [junk] * 3, dtype=dtype, device=DEVICE)


def _oracle(outputs, block_table, query_lengths, kv_offsets, next_tokens, prompt_tokens, *,
            num_requests, num_decode, active_tokens, padded_tokens, padded_requests, row_offset,
            block_size, dummy_block):
    """The contract, token by token (inputs are host lists here)."""
    token = 0
    for request in range(num_requests):
        for j in range(query_lengths[request]):
            pos = kv_offsets[request] + j
            outputs["token_to_input_ids"][token] = (next_tokens[request] if request < num_decode
                                                    else prompt_tokens[token - num_decode])
            outputs["token_to_pos_ids"][token] = pos
            outputs["token_to_request_idx"][token] = row_offset + request
            outputs["token_to_block_idx"][token] = block_table[request][pos // block_size]
            outputs["token_to_position_in_request"][token] = pos
            outputs["token_to_local_position_within_kv_block"][token] = pos % block_size
            token += 1
    assert token == active_tokens
    for token in range(active_tokens, padded_tokens):
        for name, value in zip(TOKEN_OUTPUTS, (0, 0, -1, dummy_block, 0, 0)):
            outputs[name][token] = value
    for row in range(num_requests):
        outputs["attn_block_table"][row] = torch.tensor(block_table[row], dtype=torch.int32)
    outputs["attn_block_table"][num_requests:padded_requests] = -1


def _run_case(*, query_lengths, num_decode, kv_offsets, block_size=4, max_blocks=6, pad_tokens=0,
              pad_rows=0, row_offset=0, token_dtype=torch.int64, strided_tables=False, config=None,
              seed=0):
    num_requests = len(query_lengths)
    active_tokens = sum(query_lengths)
    padded_tokens, padded_requests = active_tokens + pad_tokens, num_requests + pad_rows
    gen = torch.Generator().manual_seed(seed)
    # Distinct block ids per row; a junk row below the active ones.
    table = torch.randperm(10_000, generator=gen)[:(num_requests + 1) * max_blocks].view(
        -1, max_blocks)
    block_table = table.to(torch.int32).to(DEVICE)
    if strided_tables:
        wide = torch.full((num_requests + 1, max_blocks + 5), 31, dtype=torch.int32, device=DEVICE)
        wide[:, 2:2 + max_blocks] = block_table
        block_table = wide[:, 2:2 + max_blocks]
    next_tokens = torch.randint(100, 200, (num_requests,), generator=gen).tolist()
    prompt_tokens = torch.randint(300, 400, (active_tokens - num_decode,), generator=gen).tolist()
    cu = [0]
    for q in query_lengths:
        cu.append(cu[-1] + q)
    inputs = dict(
        block_table=block_table,
        query_lengths=_with_junk(query_lengths, torch.int32),
        kv_offsets=_with_junk(kv_offsets, torch.int32),
        cu_query_lengths=_with_junk(cu, torch.int32),
        next_tokens=_with_junk(next_tokens, token_dtype),
        prompt_tokens=_with_junk(prompt_tokens, token_dtype),
    )
    sizes = dict(num_requests=num_requests, num_decode=num_decode, active_tokens=active_tokens,
                 padded_tokens=padded_tokens, padded_requests=padded_requests,
                 row_offset=row_offset, block_size=block_size, dummy_block=DUMMY_BLOCK)
    for poison in POISONS:
        results = {}
        for who in ("triton", "torch", "oracle"):
            # The oracle writes element by element: on the host.
            device = "cpu" if who == "oracle" else DEVICE
            buffers, outputs = {}, {}
            for name in TOKEN_OUTPUTS:
                buffers[name], outputs[name] = poisoned((padded_tokens + SPARE,), torch.int64,
                                                        poison, device, guard=GUARD)
            buffers["attn_block_table"], outputs["attn_block_table"] = poisoned(
                (padded_requests + SPARE, max_blocks), torch.int32, poison, device, guard=GUARD)
            if strided_tables:
                outputs["attn_block_table"] = outputs["attn_block_table"].t().contiguous().t()
                buffers["attn_block_table"] = outputs["attn_block_table"]
            if who == "oracle":
                _oracle(outputs, block_table.tolist(), query_lengths, kv_offsets, next_tokens,
                        prompt_tokens, **sizes)
            else:
                step_metadata(**outputs, **inputs, **sizes, config=config, backend=who)
            results[who] = buffers
        for who in ("triton", "torch"):
            for name, buf in results[who].items():
                assert torch.equal(buf.cpu(), results["oracle"][name]), (
                    f"{who}: {name} (poison {poison:#x})")


CASES = [
    pytest.param(dict(query_lengths=[], num_decode=0, kv_offsets=[]), id="empty"),
    pytest.param(dict(query_lengths=[], num_decode=0, kv_offsets=[], pad_tokens=5, pad_rows=3),
                 id="zero_requests_padding"),
    pytest.param(dict(query_lengths=[1], num_decode=1, kv_offsets=[5]), id="one_decode"),
    pytest.param(dict(query_lengths=[1], num_decode=0, kv_offsets=[0]), id="one_prefill_token"),
    # Positions at the start, the end and the middle of blocks; padding tokens and rows.
    pytest.param(dict(query_lengths=[1] * 7, num_decode=7, kv_offsets=[0, 3, 4, 7, 8, 13, 23],
                      pad_tokens=3, pad_rows=2), id="decode7_padded"),
    pytest.param(dict(query_lengths=[5, 1, 9], num_decode=0, kv_offsets=[0, 3, 6]),
                 id="prefill_only"),
    # Decode rows, a new prefill, and a chunked prefill last; paused rows before (row_offset).
    pytest.param(dict(query_lengths=[1, 1, 1, 6, 7], num_decode=3, kv_offsets=[7, 8, 3, 0, 16],
                      row_offset=2, pad_tokens=2, pad_rows=1), id="mixed_chunked_paused"),
    pytest.param(dict(query_lengths=[8], num_decode=0, kv_offsets=[4]),
                 id="prefill_ends_at_block_boundary"),
    # Nine prefill rows: a four-step binary search for each token's request.
    pytest.param(dict(query_lengths=[1, 1, 3, 1, 4, 1, 5, 9, 2, 6, 5], num_decode=2,
                      kv_offsets=[0, 23, 1, 2, 3, 4, 5, 6, 7, 8, 9], pad_tokens=1),
                 id="many_prefills"),
    pytest.param(dict(query_lengths=[1, 45], num_decode=1, kv_offsets=[2, 0], max_blocks=12,
                      pad_tokens=19), id="long_prefill_many_tiles"),
    pytest.param(dict(query_lengths=[1, 1, 3], num_decode=2, kv_offsets=[9, 0, 2],
                      token_dtype=torch.int32), id="int32_tokens"),
    pytest.param(dict(query_lengths=[1, 2, 3], num_decode=1, kv_offsets=[6, 1, 5], pad_rows=2,
                      strided_tables=True), id="strided_tables"),
    # Decode only (the reference's decode shortcut): paused rows before, int32 tokens, strided
    # tables, positions on both sides of block boundaries, and the same with padding.
    pytest.param(dict(query_lengths=[1] * 5, num_decode=5, kv_offsets=[3, 4, 0, 22, 7],
                      row_offset=3, token_dtype=torch.int32, strided_tables=True),
                 id="decode_paused_int32_strided"),
    pytest.param(dict(query_lengths=[1] * 3, num_decode=3, kv_offsets=[23, 8, 1], row_offset=1,
                      pad_tokens=4, pad_rows=1), id="decode_paused_padded"),
]


@pytest.mark.parametrize("case", CASES)
def test_matches_oracle(case):
    _run_case(**case)


# Every config: a decode row, a 37-token prefill and a short one; 70 block-table columns (two
# column tiles of 64); 20 padding tokens (two token tiles of 16) and two padded rows.
ALL_CONFIGS_KEY = step_metadata_tune_key(max_blocks=70, block_size=4, num_tokens=64, num_requests=4,
                                         prefill=True)


@pytest.mark.parametrize("config", [pytest.param(c, id=str(c))
                                    for c in step_metadata_configs(ALL_CONFIGS_KEY)])
def test_every_config(config):
    _run_case(query_lengths=[1, 1, 37, 5], num_decode=2, kv_offsets=[250, 4, 3, 0], block_size=4,
              max_blocks=70, pad_tokens=20, pad_rows=2, row_offset=1, config=config)


def test_default_config_is_in_search_space():
    for max_blocks in (6, 70, 256):
        for prefill in (False, True):
            key = step_metadata_tune_key(max_blocks=max_blocks, block_size=16, num_tokens=300,
                                         num_requests=3, prefill=prefill)
            assert step_metadata_default_config(key) in step_metadata_configs(key)
            assert (key["num_tokens"], key["num_requests"]) == (512, 4)


def test_tune_cases_check_at_scaled_down_presets():
    tuning = autotune.get_tuning("step_metadata")
    for key in tuning.presets():
        check_tune_case(tuning, scaled_down_key(key))


def _small_step():
    outputs = {name: torch.full((6,), 9, dtype=torch.int64, device=DEVICE)
               for name in TOKEN_OUTPUTS}
    outputs["attn_block_table"] = torch.full((3, 4), 9, dtype=torch.int32, device=DEVICE)
    inputs = dict(
        block_table=torch.arange(8, dtype=torch.int32, device=DEVICE).view(2, 4),
        query_lengths=torch.tensor([1, 3], dtype=torch.int32, device=DEVICE),
        kv_offsets=torch.tensor([5, 0], dtype=torch.int32, device=DEVICE),
        cu_query_lengths=torch.tensor([0, 1, 4], dtype=torch.int32, device=DEVICE),
        next_tokens=torch.tensor([11, 12], device=DEVICE),
        prompt_tokens=torch.tensor([21, 22, 23], device=DEVICE),
    )
    sizes = dict(num_requests=2, num_decode=1, active_tokens=4, padded_tokens=5, padded_requests=3,
                 row_offset=0, block_size=4, dummy_block=99)
    return outputs, inputs, sizes


def test_custom_op_matches_reference():
    outputs, inputs, sizes = _small_step()
    expected = {name: t.clone() for name, t in outputs.items()}
    torch.ops.dynctx.step_metadata(*outputs.values(), *inputs.values(), *sizes.values())
    step_metadata_ref(**expected, **inputs, **sizes)
    for name in outputs:
        assert torch.equal(outputs[name], expected[name]), name
    assert outputs["token_to_block_idx"].tolist() == [1, 4, 4, 4, 99, 9]
    torch.library.opcheck(torch.ops.dynctx.step_metadata.default,
                          (*outputs.values(), *inputs.values(), *sizes.values()))


def _bad_calls():
    def call(**override):
        outputs, inputs, sizes = _small_step()
        for k, v in override.items():
            for group in (outputs, inputs, sizes):
                if k in group:
                    group[k] = v(group[k]) if callable(v) else v
        return lambda: step_metadata(**outputs, **inputs, **sizes)

    return [
        pytest.param(call(token_to_block_idx=lambda t: t.int()), "token_to_block_idx",
                     id="output_int32"),
        pytest.param(call(token_to_pos_ids=lambda t: t[:4]), "token_to_pos_ids", id="output_short"),
        pytest.param(call(token_to_input_ids=lambda t: t[::2]), "token_to_input_ids",
                     id="output_strided"),
        pytest.param(call(attn_block_table=lambda t: t[:2]), "attn_block_table", id="attn_rows"),
        pytest.param(call(attn_block_table=lambda t: t[:, :3]), "attn_block_table",
                     id="attn_columns"),
        pytest.param(call(block_table=lambda t: t.long()), "block_table", id="table_int64"),
        pytest.param(call(block_table=lambda t: t[:1]), "block_table", id="table_rows"),
        pytest.param(call(query_lengths=lambda t: t.long()), "query_lengths",
                     id="query_lengths_int64"),
        pytest.param(call(kv_offsets=lambda t: t[:1]), "kv_offsets", id="kv_offsets_short"),
        pytest.param(call(cu_query_lengths=lambda t: t[:2]), "cu_query_lengths", id="cu_short"),
        pytest.param(call(next_tokens=lambda t: t.float()), "next_tokens", id="next_tokens_float"),
        pytest.param(call(prompt_tokens=lambda t: t[:2]), "prompt_tokens", id="prompt_short"),
        pytest.param(call(num_decode=3), "num_decode", id="num_decode_past_requests"),
        pytest.param(call(padded_tokens=3), "padded_tokens", id="padded_below_active"),
        pytest.param(call(padded_requests=1), "padded_requests", id="padded_rows_below_requests"),
        pytest.param(call(block_size=0), "block_size", id="block_size_zero"),
    ]


@pytest.mark.parametrize("call, name", _bad_calls())
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs_raise(call, name, backend, monkeypatch):
    assert_raises_naming(call, name, backend, monkeypatch)
