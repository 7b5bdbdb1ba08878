"""SplitTurboQuant: channels chosen by importance at more bits, the rest at fewer (two TurboQuant MSE parts)."""

import pytest
import torch

from qjl import CodecSpec
from qjl import SplitTurboQuant, TurboQuantMSE
from qjl.core.lloyd_max import sphere_codebook


def _keys(d=64, n=400, b=2, h=3, seed=0, loud=(0, 5, 9, 17)):
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(d)
    scale[list(loud)] = 8.0
    return torch.randn(b, h, n, d, generator=g) * scale, g


def test_each_part_is_its_own_turboquant():
    """Dequantized channels come from the right part: the chosen ones carry the 8-bit part's tiny error, the others
    the 1-bit part's; and each part equals a TurboQuantMSE of its own dimension applied to those channels."""
    k, _ = _keys()
    c = SplitTurboQuant(64, bits=1, split_bits=8, n_split=16, seed=3)
    idx, = c.fit(k)
    codes = c.quantize(k, idx)
    k_hat = c.dequantize(codes)
    chosen = torch.zeros(2, 3, 64, dtype=torch.bool).scatter_(-1, idx, True).unsqueeze(2).expand_as(k)
    rel = lambda m: float(((k_hat - k)[m].square().sum() / k[m].square().sum()))  # noqa: E731
    assert rel(chosen) < 1e-3 and rel(~chosen) > 0.2
    # the chosen part is exactly a 16-dim TurboQuantMSE with the derived seed, over x[idx]
    hi = torch.gather(k, -1, idx.unsqueeze(2).expand(2, 3, 400, 16))
    assert torch.equal(c.chosen.quantize(hi).fields["codes"], codes.fields["split_codes"])
    assert c.chosen.rotation.seed != c.rest.rotation.seed


@pytest.mark.parametrize("bits, split_bits, n_split", [(2, 4, 16), (3, 5, 32), (2, 3, 32)])
def test_part_distortions_match_the_codebooks(bits, split_bits, n_split):
    """On isotropic Gaussian vectors each part's relative error is its Lloyd-Max codebook's n * mse (TurboQuant's
    D_mse for that dimension): 2,000 vectors x 6 sequences, mean within 4% (the spread of the mean is < 1%)."""
    d = 64
    x = torch.randn(2, 3, 2000, d, generator=torch.Generator().manual_seed(1))
    c = SplitTurboQuant(d, bits=bits, split_bits=split_bits, n_split=n_split, seed=5)
    idx, = c.fit(x)
    codes = c.quantize(x, idx)
    err = (c.dequantize(codes) - x).square()
    chosen = torch.zeros(2, 3, d, dtype=torch.bool).scatter_(-1, idx, True).unsqueeze(2).expand_as(x)
    for mask, n, b in ((chosen, n_split, split_bits), (~chosen, d - n_split, bits)):
        # per vector: ||x_part - x_hat_part||^2 / ||x_part||^2 -> n * mse of the n-dim sphere codebook
        per = (err * mask).sum(-1) / (x.square() * mask).sum(-1)
        want = n * sphere_codebook(n, b).mse
        assert abs(float(per.mean()) / want - 1) < 0.04, (float(per.mean()), want)


def test_inner_product_is_the_dequantized_dot_product():
    k, g = _keys()
    q = torch.randn(2, 3, 7, 64, generator=g)
    c = SplitTurboQuant(64, bits=2, split_bits=4, n_split=32, seed=1, correct_norm=True)
    codes = c.quantize(k)
    want = torch.matmul(q, c.dequantize(codes).transpose(-1, -2))
    assert torch.allclose(c.inner_product(q, codes), want, rtol=1e-5, atol=1e-3)
    # the kernels' two terms: <Pi_rest q[rest], rest> + <Pi_chosen q[idx], chosen>
    qs = c.score_queries(q, {"split_idx": codes.shared["split_idx"]})
    lo = c.rest.rotated(type(codes)(codes.lead, {"codes": codes.fields["codes"], "norm": codes.fields["norm"]}))
    hi = c.chosen.rotated(type(codes)(codes.lead, {"codes": codes.fields["split_codes"],
                                                   "norm": codes.fields["split_norm"]}))
    terms = torch.matmul(qs[0], lo.transpose(-1, -2)) + torch.matmul(qs[1], hi.transpose(-1, -2))
    assert torch.allclose(terms, want, rtol=1e-5, atol=1e-3)


def test_channels_chosen_by_key_and_query_energy():
    """Keys loud in channels A, queries loud in B: keys alone choose A; with queries the largest products win."""
    d = 32
    g = torch.Generator().manual_seed(2)
    ks, qs = torch.ones(d), torch.ones(d)
    ks[[1, 2, 3, 4, 5, 6, 7, 8]] = 4.0
    qs[[5, 6, 7, 8, 20, 21, 22, 23]] = 4.0
    k = torch.randn(1, 2, 3000, d, generator=g) * ks
    q = torch.randn(1, 2, 3000, d, generator=g) * qs
    c = SplitTurboQuant(d, bits=2, split_bits=4, n_split=8)
    by_keys, = c.fit(k)
    both, = c.fit(k, queries=q)
    assert by_keys.tolist() == [[[1, 2, 3, 4, 5, 6, 7, 8]] * 2]
    top = both[0, 0].tolist()
    assert top == sorted(top) and {5, 6, 7, 8} <= set(top)  # the 16x products, then four of the 4x ones
    assert set(top) - {5, 6, 7, 8} <= {1, 2, 3, 4, 20, 21, 22, 23}
    # per head: a second head with other loud channels chooses its own
    k2 = k.clone()
    k2[:, 1] = torch.randn(3000, d, generator=g) * torch.where(torch.arange(d) >= 24, 4.0, 1.0)
    assert c.fit(k2)[0][0, 1].tolist() == list(range(24, 32))


def test_error_lands_where_the_queries_look():
    """At equal bits (3.25 per coordinate with fp8 norms against one 3-bit group with an fp16 norm), the split's
    score error on queries that look at a few loud key channels is well below one rotation's (the measured
    reason for it, docs/cache.md)."""
    d = 64
    loud = list(range(0, 64, 4))
    k, g = _keys(loud=loud)
    qscale = torch.full((d,), 0.3)
    qscale[loud] = 3.0
    q = torch.randn(2, 3, 64, d, generator=g) * qscale
    split = SplitTurboQuant(d, bits=2, split_bits=4, n_split=32, norm_dtype="fp8", correct_norm=True, seed=1)
    plain = TurboQuantMSE(d, 3, correct_norm=True, seed=1)
    assert split.bit_budget().bits_per_vector == plain.bit_budget().bits_per_vector == 208
    exact = torch.matmul(q, k.transpose(-1, -2))
    e_split = (split.inner_product(q, split.quantize(k, *split.fit(k, q))) - exact).square().mean()
    e_plain = (plain.inner_product(q, plain.quantize(k)) - exact).square().mean()
    assert e_split < 0.6 * e_plain, (float(e_split), float(e_plain))


def test_budget_counts_everything_stored():
    c = SplitTurboQuant(128, bits=2, split_bits=5, n_split=32, norm_dtype="fp8")
    b = c.bit_budget()
    assert b.per_vector == {"codes": 96 * 2, "norm": 8, "split_codes": 32 * 5, "split_norm": 8}
    assert b.shared == {"split_idx": 32 * 8}
    codes = c.quantize(torch.randn(1, 2, 10, 128))
    for name, t in codes.fields.items():
        assert t[0, 0, 0].numel() * t.element_size() * 8 == b.per_vector[name]
    assert codes.shared["split_idx"][0, 0].numel() * 8 == b.shared["split_idx"]
    assert SplitTurboQuant(512, n_split=64).bit_budget().shared == {"split_idx": 64 * 16}  # int16 past 256 channels


def test_spec_per_head_dim():
    spec = CodecSpec("turboquant_split", {"bits": 2, "split_bits": 4}, per_dim={"n_split": 0.25})
    assert spec.build(128).n_split == 32 and spec.build(64).n_split == 16


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_split must be a multiple of 8"):
        SplitTurboQuant(64, n_split=12)
    with pytest.raises(ValueError, match="n_split must leave"):
        SplitTurboQuant(64, n_split=64)
    with pytest.raises(ValueError, match="split_bits must be in 1..8"):
        SplitTurboQuant(64, split_bits=9)
    c = SplitTurboQuant(64, n_split=8)
    k = torch.randn(2, 5, 64)
    with pytest.raises(ValueError, match="split_idx values"):
        c.quantize(k, torch.tensor([0, 1, 2, 3, 4, 5, 6, 64]))
    with pytest.raises(ValueError, match="repeat"):
        c.quantize(k, torch.tensor([0, 1, 2, 3, 4, 5, 6, 6]))
    with pytest.raises(ValueError, match="n_split=8"):
        c.quantize(k, torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="split_idx"):
        c.quantize(k, torch.arange(8.0))
    with pytest.raises(ValueError, match="x contains NaN"):
        c.quantize(torch.full((3, 64), float("nan")))
    with pytest.raises(ValueError, match="queries"):
        c.fit(k, queries=torch.randn(2, 4, 32))
    with pytest.raises(ValueError, match="does not broadcast"):
        c.fit(torch.randn(2, 5, 64), queries=torch.randn(3, 4, 64))
    with pytest.raises(ValueError, match="split_idx"):
        c.score_queries(torch.randn(2, 1, 64))
    with pytest.raises(ValueError, match="split_idx"):
        c.dequantize(type(c.quantize(k))((2, 5), c.quantize(k).fields))

