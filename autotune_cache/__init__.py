"""dynctx.autotune_cache."""
