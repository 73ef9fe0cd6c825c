import pytest
import torch

from helpers import tiny_llama


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny models' steps took 50x longer with two on a busy
    2-core machine (measured in tests/test_preemption.py); launched workers use one too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
