"""Rows of the packed per-request int32 table, and the layer-type symbols."""

# Rows of the packed per-request int32 table.
FIELD_IDS, FIELD_QUERY, FIELD_OUTPUT, FIELD_KV_OFFSET, FIELD_BLOCKS, FIELD_LAST_BLOCK, \
    FIELD_LAST_OFFSET, FIELD_MAMBA_SLOT = range(8)
NUM_FIELDS = 8
# Values a free row holds (Megatron-Core's reset values).
_FIELD_RESET = {FIELD_IDS: -1, FIELD_LAST_BLOCK: -1, FIELD_MAMBA_SLOT: -1}
_LAYER_SYMBOLS = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE"}
