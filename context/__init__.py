"""The dynamic inference context: errors, requests, block allocator and the context itself."""
