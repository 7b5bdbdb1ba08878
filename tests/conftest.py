import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    torch.manual_seed(0)
    yield
