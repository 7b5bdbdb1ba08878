"""Benchmark helpers: recall, exact top-k, the bar verdicts (no peers needed)."""

import numpy as np
import pytest
import torch

from qjl.search.bench import bars, exact_topk, format_bars, recall_at


def test_recall_and_exact_topk():
    x, q = torch.randn(300, 16), torch.randn(5, 16)
    truth = exact_topk(x, q, 10).numpy()
    assert recall_at(truth, truth, 10) == 1.0
    shifted = np.roll(truth, 5, axis=1)
    assert recall_at(shifted, truth, 1) == 0.0 and recall_at(shifted, truth, 10) == 1.0


def _row(method, family, b, bits, r10, qps, enc=1000.0):
    return {"method": method, "family": family, "regime": "flat", "budget_bits": b, "bits_per_dim": bits,
            "recall@10": r10, "qps_1t": qps, "encode_vectors_per_s": enc}


def test_bars_say_met_and_not_met_plainly():
    rows = [_row("qjl a b2", "qjl a", 2, 2.04, 0.830, 500, 2000), _row("qjl b b2", "qjl b", 2, 2.04, 0.80, 900),
            _row("faiss SQtqmse2 RR", "faiss SQtqmse RR", 2, 2.0, 0.82, 100, 1500),
            _row("faiss RaBitQfs2", "faiss RaBitQfs", 2, 2.4, 0.845, 2000)]
    (b,) = bars({"rows": rows}, "flat")
    assert b["ours_best"] == "qjl a b2" and b["bar_recall_vs_tq"] and not b["bar_recall_vs_rabitq"]
    assert b["ours_fastest"] == "qjl b b2" and b["qps_ratio_1t"] == 900 / 2000 and not b["bar_qps"]
    assert b["bar_encode"] and b["faiss_rabitq_bits_per_dim"] == 2.4
    assert "NOT met" in format_bars({"rows": rows})


def test_our_bits_count_every_per_vector_byte():
    """The bench's bits per dimension for our index are the index's own per-vector bytes: codes, the factor,
    and for a centered index the stored <c, x> (16 bits more)."""
    import numpy as np

    from qjl.search.bench import _Ours

    x = np.random.default_rng(0).standard_normal((100, 64)).astype(np.float32)
    plain, cent = _Ours("tq-mse-rn", 2, 64, 0, 1), _Ours("tq-mse-rn+c", 2, 64, 0, 1)
    for m in (plain, cent):
        m.build(x, x)
    assert plain.code_bits() == 8 * (64 * 2 // 8 + 2)
    assert cent.code_bits() == plain.code_bits() + 16


def test_parse_ours_flags():
    from qjl.search.bench import parse_ours

    assert parse_ours("tq-mse-rn") == ("tq-mse-rn", {"center": False, "rotation": "haar"})
    assert parse_ours("tq-mse-rn+ch") == ("tq-mse-rn", {"center": True, "rotation": "hadamard"})
    assert parse_ours("tq-mse-rn+ck") == ("tq-mse-rn", {"center": True, "rotation": "hadamard-kron"})
    with pytest.raises(ValueError, match="flags"):
        parse_ours("tq-mse-rn+hk")
    with pytest.raises(ValueError, match="flags"):
        parse_ours("tq-mse-rn+x")
