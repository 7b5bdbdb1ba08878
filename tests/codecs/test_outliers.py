import pytest
import torch

from qjl import OutlierQJL, QJLSketch


def _keys(*lead, d=128, outliers=(3, 17, 40, 77)):
    k = torch.randn(*lead, d)
    k[..., list(outliers)] *= 12
    return k


@pytest.mark.parametrize("kind", ["gaussian", "orthogonal", "hadamard"])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_dequantize_consistency_and_shapes(kind, d):
    codec = OutlierQJL(d, 8 * (d // 8 + 3), n_outliers=4, outlier_sketch_dim=40, kind=kind, seed=4, norm_dtype="fp32")
    k = _keys(2, 3, 11, d=d, outliers=(1, 9, 30, d - 1))
    q = torch.randn(2, 3, 5, d)
    codes = codec.quantize(k)
    assert codes.shared["outlier_idx"].tolist()[0][0] == [1, 9, 30, d - 1]  # chosen from the data
    scores = codec.inner_product(q, codes)
    assert scores.shape == (2, 3, 5, 11)
    k_hat = codec.dequantize(codes)
    assert k_hat.shape == k.shape
    assert torch.allclose(scores, q @ k_hat.transpose(-1, -2), rtol=1e-4, atol=1e-3)


def test_norms_stored_directly():
    codec = OutlierQJL(64, 64, n_outliers=2, outlier_sketch_dim=16, norm_dtype="fp32")
    k = torch.randn(4, 64)
    idx = torch.tensor([5, 9])
    codes = codec.quantize(k, idx)
    inl = k.clone()
    inl[:, idx] = 0
    assert torch.allclose(codes.fields["norm"], inl.norm(dim=-1))
    assert torch.allclose(codes.fields["outlier_norm"], k[:, idx].norm(dim=-1))


def test_outlier_split_reduces_error_on_outlier_keys():
    """The point of Section 4.1: with outlier channels split off, scores are closer."""
    torch.manual_seed(1)
    k = _keys(400)
    q = torch.randn(16, 128)
    true = q @ k.T
    plain = QJLSketch(128, 256, seed=0)
    split = OutlierQJL(128, 256, n_outliers=4, outlier_sketch_dim=64, seed=0)
    err_plain = (plain.inner_product(q, plain.quantize(k)) - true).pow(2).mean()
    err_split = (split.inner_product(q, split.quantize(k)) - true).pow(2).mean()
    assert err_split < 0.5 * err_plain


def test_per_head_indices_broadcast():
    codec = OutlierQJL(64, 64, n_outliers=2, outlier_sketch_dim=16, norm_dtype="fp32")
    k = torch.randn(2, 3, 6, 64)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5]])  # per head, shared by the batch
    codes = codec.quantize(k, idx)
    assert codes.shared["outlier_idx"].shape == (2, 3, 2)
    one = codec.quantize(k[:, 1:2], idx[1:2])
    assert torch.equal(codes.fields["outlier_signs"][:, 1:2], one.fields["outlier_signs"])


def test_no_outliers_is_plain_qjl():
    codec = OutlierQJL(64, 64, n_outliers=0, seed=3)
    k = torch.randn(5, 64)
    plain = QJLSketch(64, 64, seed=3)
    assert torch.equal(codec.quantize(k).fields["signs"], plain.quantize(k).fields["signs"])
    assert codec.bit_budget() == plain.bit_budget()


def test_budget_counts_indices():
    codec = OutlierQJL(128, 256, n_outliers=8, outlier_sketch_dim=64, norm_dtype="fp16")
    b = codec.bit_budget()
    assert b.per_vector == {"signs": 256, "norm": 16, "outlier_signs": 64, "outlier_norm": 16}
    assert b.shared == {"outlier_idx": 64}
    assert OutlierQJL(512, 256, n_outliers=8, outlier_sketch_dim=64).bit_budget().shared == {"outlier_idx": 128}


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_outliers"):
        OutlierQJL(64, 64, n_outliers=64, outlier_sketch_dim=8)
    with pytest.raises(ValueError, match="outlier_sketch_dim"):
        OutlierQJL(64, 64, n_outliers=4, outlier_sketch_dim=0)
    with pytest.raises(ValueError, match="outlier_sketch_dim must be a multiple of 8"):
        OutlierQJL(64, 64, n_outliers=4, outlier_sketch_dim=12)
    codec = OutlierQJL(64, 64, n_outliers=2, outlier_sketch_dim=16)
    k = torch.randn(3, 64)
    with pytest.raises(ValueError, match="outlier_idx values"):
        codec.quantize(k, torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="repeat"):
        codec.quantize(k, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="n_outliers=2"):
        codec.quantize(k, torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="outlier_idx"):
        codec.quantize(k, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        codec.quantize(torch.randn(64))
    with pytest.raises(ValueError, match="x contains NaN"):
        codec.quantize(torch.full((3, 64), float("nan")))
