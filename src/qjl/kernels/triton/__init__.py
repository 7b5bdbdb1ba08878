"""Triton kernels (CUDA; on the CPU through ``TRITON_INTERPRET=1``).  Import only where Triton is installed."""
