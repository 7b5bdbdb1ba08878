#!/bin/bash
# The GPU session of 2026-11-29 (eighth session): native Triton tests, then the kernel timings.
# Run from the repository root on the lent machine: bash docs/runs/gpu-h200-20261129/run.sh
export PYTHONPATH=$PWD/src QJL_CACHE_DIR=/tmp/qjl-cache TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt 2>&1
python -c "import sys, torch, triton, transformers; print(sys.version, torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/env.txt 2>&1
timeout ${TEST_S:-230} python -m pytest -q -p no:cacheprovider tests/kernels/test_triton.py tests/kernels/test_triton_scan.py \
    tests/integrations/test_vllm_decode.py tests/core/test_devices.py > $OUT/pytest-native.log 2>&1
echo "pytest rc $?" >> $OUT/pytest-native.log
timeout ${BENCH_S:-210} python benchmarks/gpu_kernels.py --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
tail -3 $OUT/pytest-native.log; grep -v "^ " $OUT/bench.log | tail -60
