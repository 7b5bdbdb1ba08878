cd /work/main
for round in 1 2 3; do
  for which in old new; do
    if [ $which = old ]; then cp /tmp/scratch/old/decode.c /tmp/scratch/old/decode_avx2.c src/qjl/kernels/cpu/; else cp /tmp/scratch/decode.c.new src/qjl/kernels/cpu/decode.c; cp /tmp/scratch/decode_avx2.c.new src/qjl/kernels/cpu/decode_avx2.c; fi
    for cfg in "128 4 16384 8 128" "64 3 16384 3 128" "128 4 65536 8 65536"; do
      set -- $cfg
      r=$(cd /tmp && BS=$5 python docs/runs/pair-tables-ab-20261129/kvar.py $1 $2 $3 $4 tq-k3v2,tqv-k3v2,vqK 9 2>&1 | tail -3 | awk '{print $1, $NF}' | tr '\n' ' ')
      echo "$round $which d=$1 R=$2 n=$3 bs=$5: $r"
    done
  done
done
cp /tmp/scratch/decode.c.new src/qjl/kernels/cpu/decode.c; cp /tmp/scratch/decode_avx2.c.new src/qjl/kernels/cpu/decode_avx2.c
