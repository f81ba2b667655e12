"""End-to-end tests: a small random Llama from ``transformers`` through the context and engine."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Small matmuls run fastest on one thread (and a loaded 2-core machine makes a second
    thread spin); restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
