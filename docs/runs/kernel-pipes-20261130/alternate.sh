#!/bin/bash
# Alternate two builds of decode_vnni.c through benchmarks/kernel_speed.py (run from the repository root):
#   git show 0643c06:src/qjl/kernels/cpu/decode_vnni.c > /tmp/base.c; git show e46a9ac:src/qjl/kernels/cpu/decode_vnni.c > /tmp/new.c
#   bash docs/runs/kernel-pipes-20261130/alternate.sh 2 /tmp/base.c /tmp/new.c
# The C module is rebuilt per source (keyed by its hash in $QJL_CACHE_DIR), so each build compiles once.
N=$1; shift
keep=$(mktemp); cp src/qjl/kernels/cpu/decode_vnni.c "$keep"
for i in $(seq "$N"); do
  for v in "$@"; do
    cp "$v" src/qjl/kernels/cpu/decode_vnni.c
    echo "== $v (round $i)"
    python benchmarks/kernel_speed.py --tokens 65536 --codecs ${CODECS:-tq-k3v2 tq-k45v3} --threads 1 2 \
        --layouts ${LAYOUTS:-contiguous paged-16 paged-128} ${EXTRA:-} --impls c-int --repeats 15 --out /tmp/kernel-pipes 2>&1 | grep threads
  done
done
cp "$keep" src/qjl/kernels/cpu/decode_vnni.c
