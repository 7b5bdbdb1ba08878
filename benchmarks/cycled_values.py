"""The CPU decode kernel with values over rotations in turn (TurboQuantMSE ``cycles=K``) against one rotation, side by
side in one process: one decode call per layer geometry, the same code bytes, calls alternated round-robin after
warm-up, medians of wall time (and of the calling thread's CPU time, which excludes time the machine took the core
away; with ``--threads 1`` the kernel runs on that thread).

    python benchmarks/cycled_values.py [--calls 200] [--threads 1] [--ks 1 8]

Keys TurboQuantMSE(d, 3, correct_norm), values TurboQuantMSE(d, 2, correct_norm, fp8 norms) (the ``tq-k3v2`` preset),
one sequence, the AVX2 path where the CPU has it (impl "c"), no exact tokens; contiguous codes (the transformers cache)
and shuffled blocks of 16 slots (vLLM's layout).  A benchmark, not a test."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from paged_pool import code_layout  # noqa: E402

from qjl.codecs import TurboQuantMSE  # noqa: E402
from qjl.kernels.cpu import launch  # noqa: E402

GEOMETRIES = {"smollm2 8k d64 3 heads 3 rows": (8192, 64, 3, 3), "llama-3-8b 16k d128 8 heads 4 rows": (16384, 128, 8, 4)}


def cases(ks):
    torch.manual_seed(0)
    out = []
    for gname, (n, d, h, r) in GEOMETRIES.items():
        kc = TurboQuantMSE(d, 3, correct_norm=True)
        v1 = TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8")
        kcodes, vcodes = kc.quantize(torch.randn(1, h, n, d)), v1.quantize(torch.randn(1, h, n, d))
        q = torch.randn(1, h, r, d) * 0.3
        st, en = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
        for layout in ("contiguous", "paged-16"):
            kf, vf, bt, bs = code_layout(kcodes, vcodes, layout, n)
            for k in ks:  # (the codes' bytes are the same for every K: only the mixing differs)
                vc = v1 if k == 1 else TurboQuantMSE(d, 2, correct_norm=True, norm_dtype="fp8", cycles=k)
                out.append((f"{gname}, {layout}", k, (q, kc, kf, vc, vf, bt, bs, st, en)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    a = p.parse_args()
    todo = cases(a.ks)
    for *_, args in todo:
        for _ in range(5):
            launch.paged_decode(*args, impl="c", threads=a.threads)
    wall, cpu = {}, {}
    for _ in range(a.calls):
        for name, k, args in todo:
            w0, c0 = time.perf_counter(), time.thread_time()
            launch.paged_decode(*args, impl="c", threads=a.threads)
            cpu.setdefault((name, k), []).append(time.thread_time() - c0)
            wall.setdefault((name, k), []).append(time.perf_counter() - w0)
    print(f"threads={a.threads}, {a.calls} calls per config after 5 warm-up calls; medians in microseconds")
    print(f"{'geometry, layout':48s} {'K':>3s} {'wall':>9s} {'cpu':>9s} {'wall/K=1':>9s} {'cpu/K=1':>8s}")
    for (name, k), ts in wall.items():
        w, c = statistics.median(ts) * 1e6, statistics.median(cpu[(name, k)]) * 1e6
        w1, c1 = (statistics.median(x[(name, a.ks[0])]) * 1e6 for x in (wall, cpu))
        print(f"{name:48s} {k:3d} {w:9.0f} {c:9.0f} {w / w1:9.3f} {c / c1:8.3f}")


if __name__ == "__main__":
    main()
