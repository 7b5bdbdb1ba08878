"""`qjl bench` plumbing on tiny sizes (a smoke test: no speed is asserted; the benchmark is not a test)."""

import json

import pytest

import torch

from qjl.tools import bench


def test_attention_and_quantize_rows(tmp_path):
    torch.set_grad_enabled(False)
    bw = bench.measure_bandwidth(mib=8, repeats=1, warmup=0)
    assert bw["copy_gbps"] > 0 and bw["read_gbps"] > 0
    rows = bench.run_attention(contexts=(300,), layers=("smollm2-135m",), presets=("tq-k3v2",), repeats=1, warmup=0,
                               bandwidth_gbps=bw["copy_gbps"], flush_caches=False)
    methods = {r["method"] for r in rows}
    assert {"sdpa-fp32 (enable_gqa)", "sdpa-fp32 (rows)", "sdpa-bf16 (rows)", "kivi-k2v2 dequant+sdpa"} <= methods
    ours = [r for r in rows if r["method"].startswith("tq-k3v2")]
    # one row per codec pair of the preset's layers (3-bit keys in layers 0-27, 4-bit in the last two)
    assert [r["method"] for r in ours] == ["tq-k3v2 L0-27 [cpu c]", "tq-k3v2 L28-29 [cpu c]"]  # the CPU kernel
    assert ours[0]["bytes"] < ours[1]["bytes"]  # wider keys hold more
    assert bench.layer_groups("tq-k45v3") == [(0, 14), (15, 29)] and bench.layer_groups("qjl-paper") == [(0, 29)]
    fp32 = next(r for r in rows if r["method"] == "sdpa-fp32 (rows)")
    assert fp32["bytes"] == 2 * 3 * 300 * 64 * 4
    assert 0 < ours[0]["bytes"] < fp32["bytes"] / 2  # bytes held (128-token fp16 window included): smaller
    for r in rows:
        assert r["ms"] > 0 and abs(r["x_vs_sdpa_fp32_rows"] - fp32["ms"] / r["ms"]) < 1e-9
        assert abs(r["roofline"] - r["bytes"] / r["ms"] / 1e6 / bw["copy_gbps"]) < 1e-9
    q = bench.run_quantize(tokens=256, layer="smollm2-135m", repeats=1, warmup=0)
    assert q["quantize_over_attention"] == q["quantize_ms"] / q["prefill_attention_ms"]
    bench.plot_bench(rows, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0
    json.dumps(rows)


def test_decode_rows_are_timed_in_interleaved_rounds(monkeypatch):
    """Every method once per round (warm-up rounds first), each row the median of its own calls."""
    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock) / 1e3)
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b") or next(clock)}
    ms = bench._interleaved_ms(fns, repeats=3, warmup=1, flush=lambda: calls.append("flush") or next(clock))
    assert calls == ["a", "b"] + ["flush", "a", "flush", "b"] * 3
    assert ms == pytest.approx({"a": 1.0, "b": 2.0})  # "b" takes one more tick per call; the flush is not timed


def test_cpu_rows_name_the_kernel_path(monkeypatch):
    """Where the integer path is the default, the fp32 path is timed beside it, and the integer path on vpdpbusd
    beside its AMX engine (the tests run "c": conftest)."""
    from qjl.kernels.cpu import launch

    assert bench._impls("triton") == [("triton", None)]
    monkeypatch.setenv("QJL_CPU_IMPL", "c-amx")
    assert bench._impls("cpu") == [("cpu c-amx", "c-amx"), ("cpu c-int", "c-int"), ("cpu c", "c")]
    monkeypatch.setenv("QJL_CPU_IMPL", "c-int" if launch.has_int_path() else "c")
    want = [("cpu c-int", "c-int"), ("cpu c", "c")] if launch.has_int_path() else [("cpu c", "c")]
    assert bench._impls("cpu") == want
    seen = []
    assert bench._with_impl("c-portable", lambda: seen.append(launch.default_impl()) or 7) == 7
    assert seen == ["c-portable"] and launch.default_impl() == want[0][1]  # restored


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="layer"):
        bench.run_attention(contexts=(64,), layers=("gpt-5",))
    with pytest.raises(ValueError, match="contexts"):
        bench.run_attention(contexts=(0,))
    with pytest.raises(TypeError, match="flush_caches"):
        bench.run_attention(contexts=(64,), flush_caches="yes")
    with pytest.raises(ValueError, match="num_layers"):
        bench.layer_groups("tq-k3v2", 0)
    with pytest.raises(ValueError, match="preset"):
        bench.layer_groups("tq-k9v9")
    with pytest.raises(ValueError, match="layer"):
        bench.run_quantize(tokens=64, layer="nope")
    with pytest.raises(ValueError, match="methods"):
        bench.run_e2e(context=64, methods=("static",))
    with pytest.raises(ValueError, match="parts"):
        bench.main_bench(None, (64,), 1, 0, 64, 1, parts=("speed",))


def test_flush_exceeds_the_largest_reported_cache(tmp_path):
    """The read before every timed call is twice the largest cache Linux reports (a VM's 480 MiB L3 included), at
    least 128 MiB and at most 2 GiB; unreadable or odd entries are skipped."""
    from qjl.tools import bench

    def caches(*sizes):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for i, size in enumerate(sizes):
            (root / f"index{i}").mkdir(parents=True)
            (root / f"index{i}" / "size").write_text(size + "\n")
        return root

    assert bench.largest_cache_mib(caches("48K", "2048K", "491520K")) == 480
    assert bench.flush_mib(caches("48K", "2048K", "491520K")) == 960
    assert bench.flush_mib(caches("32K", "1024K", "32768K")) == 128  # a 32 MiB L3: the 128 MiB floor
    assert bench.flush_mib(caches("4G")) == 2048
    assert bench.flush_mib(caches("junk", "64M")) == 128
    assert bench.flush_mib(tmp_path / "none") == 128
