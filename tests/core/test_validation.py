"""check_vectors: the fast finite-sum path refuses exactly what the element-wise check refuses."""

import pytest
import torch

from qjl.core.validation import check_vectors


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_finite_refused(bad, dtype):
    x = torch.randn(7, 16).to(dtype)
    x[3, 5] = bad
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        check_vectors("x", x, 16)


def test_finite_values_whose_sum_overflows_pass():
    for x in (torch.full((4, 16), 3e38), torch.full((4, 16), 6e4, dtype=torch.float16)):
        assert torch.isinf(x.sum())  # the fast path cannot decide: the element-wise check must
        assert check_vectors("x", x, 16) is x
