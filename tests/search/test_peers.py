"""The benchmark end to end on a small synthetic set, with faiss and rabitqlib (marker: search)."""

import json

import pytest

from qjl.search.bench import BenchConfig, run_search_bench
from qjl.search.peers import faiss_available, rabitqlib_available

pytestmark = [pytest.mark.search,
              pytest.mark.skipif(not (faiss_available() and rabitqlib_available()), reason="needs qjl[search]")]


def test_bench_runs_every_method_and_counts_bits(tmp_path):
    cfg = BenchConfig(n=1500, queries=40, speed_queries=20, repeats=1, bits=(2,), dataset="synthetic", nlist=8,
                      nprobe=8, ours=("tq-mse-rn", "tq-mse-rn+c"))
    result = run_search_bench(cfg, tmp_path, progress=False)
    rows = {r["method"]: r for r in result["rows"] if r["regime"] == "flat"}
    assert not [r for r in result["rows"] if "error" in r]
    assert rows["faiss Flat"]["recall@10"] == pytest.approx(1.0)
    assert rows["qjl tq-mse-rn b2"]["bits_per_dim"] == pytest.approx((96 + 2) * 8 / 384)
    assert rows["faiss SQtqmse2 RR"]["bits_per_dim"] == pytest.approx(2.0)
    assert rows["faiss RaBitQ2"]["recall@10"] > 0.3 and rows["rabitqlib flat 2"]["recall@10"] > 0.3
    # IVF probing every list: residual codes (not the flat codes, so not bit-identical results; the exact
    # equality with by_residual=False is tested in test_index), recall as good as the flat scan's within noise
    ivf = {r["method"]: r for r in result["rows"] if r["regime"] == "ivf"}
    assert ivf["qjl tq-mse-rn b2"]["recall@10"] >= rows["qjl tq-mse-rn b2"]["recall@10"] - 0.05
    assert "qjl tq-mse-rn+c b2" not in ivf  # centering is what by_residual already does: not run twice
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == len(result["rows"]) and (tmp_path / "recall10.png").exists()
