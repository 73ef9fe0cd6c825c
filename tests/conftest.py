import pytest

from helpers import tiny_llama


@pytest.fixture
def llama():
    return tiny_llama()
