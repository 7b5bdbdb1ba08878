"""The product behind "torch's bf16 GEMMs run ~50x slower than fp32" on CPUs without bf16 arithmetic (scratch,
2026-11-27): one [512, 576] x [576, 1536] product (a 512-token chunk through a SmolLM2 MLP projection's shape),
fp32 against bf16, 2 threads, mean of 20 after 3 warm-ups.  `python docs/runs/avx2-scratch-20261127/bf16_gemm.py`."""
import time

import torch

torch.set_num_threads(2)
for dt in (torch.float32, torch.bfloat16):
    a, w = torch.randn(512, 576, dtype=dt), torch.randn(576, 1536, dtype=dt)
    for _ in range(3):
        a @ w
    t = time.perf_counter()
    for _ in range(20):
        a @ w
    print(f"{dt}: {(time.perf_counter() - t) / 20 * 1e3:.1f} ms")
