import os

# Triton kernels are tested on the CPU through Triton's interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    torch.manual_seed(0)
    yield
