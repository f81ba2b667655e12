"""dynctx.models."""
