#!/bin/bash
# $1 = label
PYTHONPATH=${SCRATCH_SRC:-src} QJL_CACHE_DIR=/tmp/qjl-cache-exp-$1 timeout 900 python docs/runs/kernel-split-20261129-zen5/ks_split.py --tokens 65536 --codecs tq-k3v2 tqk-tqv8 --threads 1 --layouts contiguous --impls c-int --rows 4 --dims 128 --out /tmp/qjl-ks 2>&1 | grep threads | sed "s/^/$1 /"
