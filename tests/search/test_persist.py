"""save / load round trip, and files a codec would read differently are refused."""

import pytest
import torch

from qjl.search import Index


@pytest.mark.parametrize("kw", [dict(codec="tq-mse-rn", bits=3), dict(codec="tq-mse-rn", bits=1, rotation="hadamard", center=True), dict(codec="tq-prod", bits=2, metric="l2", rerank=2),
                                dict(codec="tq-mse-rn", bits=2, rotation="hadamard-kron", center=True),
                                dict(codec="qjl", bits=1, nlist=4), dict(codec="tq-mse-rn", bits=2, center=True)])
def test_round_trip(tmp_path, kw):
    x = torch.randn(300, 64)
    ix = Index.create(64, **kw)
    if ix.config.nlist:
        ix.train(x)
    ix.add(x, ids=torch.arange(300) + 1000)
    ix.remove(torch.tensor([1000, 1001]))
    ix.save(tmp_path / "ix.pt")
    back = Index.load(tmp_path / "ix.pt")
    q = torch.randn(5, 64)
    a, b = ix.search(q, 8, nprobe=2), back.search(q, 8, nprobe=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert back.nbytes() == ix.nbytes() and back.next_id == ix.next_id
    assert back.add(x[:1])[0] == ix.next_id


def test_refuses_foreign_or_mismatched_files(tmp_path):
    torch.save({"format": "something else"}, tmp_path / "a.pt")
    with pytest.raises(ValueError, match="not a"):
        Index.load(tmp_path / "a.pt")
    ix = Index.create(64, bits=2)
    ix.add(torch.randn(10, 64))
    ix.save(tmp_path / "b.pt")
    state = torch.load(tmp_path / "b.pt", weights_only=True)
    state["fingerprint"] = state["fingerprint"] + 1
    torch.save(state, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="encodes differently"):
        Index.load(tmp_path / "c.pt")
