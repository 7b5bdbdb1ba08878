"""The CPU decode kernel reading a vector codebook's codes (TurboQuantVQ: rotated coordinates quantized g at a time,
each group's g fields one joint code) against the scalar TurboQuantMSE codes of the same widths, side by side in one
process: one decode call per layer geometry, calls alternated round-robin after warm-up, medians of wall time (and
of the calling thread's CPU time, which excludes time the machine took the core away; with ``--threads 1`` the
kernel runs on that thread).

    python benchmarks/vector_codes.py [--calls 200] [--threads 1] [--impl c]

Keys 3 bits (correct_norm), values 2 bits (fp8 norms, correct_norm) over 8 rotations in turn -- the widths
``QJLConfig.auto(3.0)`` picks --, as TurboQuantMSE (scalar Lloyd-Max cells: the AVX2 path's lane-sliced loops,
"scalar"), with the keys as TurboQuantVQ (pairs of 6-bit joint codes: the AVX2 loops loading each joint code's floats
from its table; "vq keys", AutoBits' default vector_keys), and with both roles as TurboQuantVQ (the values in fours of
8-bit joint codes too; "vq both"); one sequence, no exact tokens; contiguous codes (the transformers cache) and
shuffled blocks of 16 slots (vLLM's layout).  ``--impl c-portable``: the build without SIMD.  A benchmark, not a
test."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from paged_pool import code_layout  # noqa: E402

from qjl.codecs import TurboQuantMSE, TurboQuantVQ  # noqa: E402
from qjl.kernels.cpu import launch  # noqa: E402

GEOMETRIES = {"smollm2 8k d64 3 heads 3 rows": (8192, 64, 3, 3), "llama-3-8b 16k d128 8 heads 4 rows": (16384, 128, 8, 4)}
KINDS = ("scalar", "vq keys", "vq both")


def pair(kind: str, d: int):
    """(keys, values) at 3 / 2 bits: TurboQuantMSE, or TurboQuantVQ for the keys ("vq keys") or both ("vq both")."""
    kcls = TurboQuantMSE if kind == "scalar" else TurboQuantVQ
    vcls = TurboQuantVQ if kind == "vq both" else TurboQuantMSE
    return kcls(d, 3, correct_norm=True), vcls(d, 2, norm_dtype="fp8", correct_norm=True, cycles=8)


def cases():
    torch.manual_seed(0)
    out = []
    for gname, (n, d, h, r) in GEOMETRIES.items():
        k, v = torch.randn(1, h, n, d), torch.randn(1, h, n, d)
        q = torch.randn(1, h, r, d) * 0.3
        st, en = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
        for kind in KINDS:
            kc, vc = pair(kind, d)
            kcodes, vcodes = kc.quantize(k), vc.quantize(v)
            for layout in ("contiguous", "paged-16"):
                kf, vf, bt, bs = code_layout(kcodes, vcodes, layout, n)
                out.append((f"{gname}, {layout}", kind, (q, kc, kf, vc, vf, bt, bs, st, en)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--impl", default="c", choices=("c", "c-portable", "c-int", "c-amx"))
    a = p.parse_args()
    todo = cases()
    for *_, args in todo:
        for _ in range(5):
            launch.paged_decode(*args, impl=a.impl, threads=a.threads)
    wall, cpu = {}, {}
    for _ in range(a.calls):
        for name, kind, args in todo:
            w0, c0 = time.perf_counter(), time.thread_time()
            launch.paged_decode(*args, impl=a.impl, threads=a.threads)
            cpu.setdefault((name, kind), []).append(time.thread_time() - c0)
            wall.setdefault((name, kind), []).append(time.perf_counter() - w0)
    print(f"impl={a.impl}, threads={a.threads}, {a.calls} calls per config after 5 warm-up calls; keys 3 bits, values 2 "
          "bits fp8 over 8 rotations; medians in microseconds")
    print(f"{'geometry, layout':48s} {'codes':>8s} {'wall':>9s} {'cpu':>9s} {'wall/sc':>8s} {'cpu/sc':>7s}")
    names = list(dict.fromkeys(name for name, _ in wall))
    for name, kind in ((name, kind) for name in names for kind in KINDS):
        ts = wall[(name, kind)]
        w, c = statistics.median(ts) * 1e6, statistics.median(cpu[(name, kind)]) * 1e6
        w1, c1 = (statistics.median(x[(name, KINDS[0])]) * 1e6 for x in (wall, cpu))
        print(f"{name:48s} {kind:>8s} {w:9.0f} {c:9.0f} {w / w1:8.3f} {c / c1:7.3f}")


if __name__ == "__main__":
    main()
