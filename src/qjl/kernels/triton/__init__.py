"""Triton kernels (CUDA; on the CPU through ``TRITON_INTERPRET=1``): ``@triton.jit`` bodies in
:mod:`qjl.kernels.triton.jit`, their launchers in :mod:`qjl.kernels.triton.launch`.  Import only where
Triton is installed."""
