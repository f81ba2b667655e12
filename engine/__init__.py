"""dynctx.engine."""
